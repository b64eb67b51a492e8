//! The in-process engine: scheduler core → launch record → worker → completion → scheduler,
//! over in-process queues (DESIGN.md section 1, offline path).
//!
//! Contract: the engine publishes up to `max_inflight` launches before executing the oldest, so
//! asynchronous scheduling (`PendingFrom` rows) runs here exactly as across processes. It
//! reports a launch released to the scheduler only after the backend returned from it (its
//! fence). A backend that keeps launches in flight ([`Backend::max_in_flight`] > 1: CUDA) gets
//! the published launches submitted ahead, as the worker daemon does, and they are finished,
//! completed and released in launch order.

use baton_proto::Launch;
use baton_scheduler::{
    AdmitError, Event, NewRequest, RequestId, Scheduler, SchedulerConfig, SchedulerStats,
};
use baton_worker::{Backend, WorkerError};
use std::collections::VecDeque;

/// Scheduler and worker in one process.
pub struct LocalEngine<B: Backend> {
    sched: Scheduler,
    backend: B,
    published: VecDeque<Launch>,
    /// Launches submitted to the backend and not yet finished (see [`Backend::submit`]).
    submitted: VecDeque<Launch>,
}

impl<B: Backend> LocalEngine<B> {
    /// An engine over `backend`, whose KV pool must match `cfg.num_blocks` and `cfg.block_size`.
    pub fn new(cfg: SchedulerConfig, backend: B) -> Self {
        let cap = backend.kv_capacity();
        assert!(
            cap.num_blocks >= cfg.num_blocks && cap.block_size == cfg.block_size,
            "backend KV pool {cap:?} does not cover the scheduler's {} pages of {}",
            cfg.num_blocks,
            cfg.block_size
        );
        let vocab = backend.vocab_size();
        Self {
            sched: Scheduler::new_local(cfg, vocab),
            backend,
            published: VecDeque::new(),
            submitted: VecDeque::new(),
        }
    }

    /// The scheduler (for traces and stats).
    pub fn scheduler_mut(&mut self) -> &mut Scheduler {
        &mut self.sched
    }

    /// Scheduler counts.
    pub fn stats(&self) -> SchedulerStats {
        self.sched.stats()
    }

    /// The backend.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// Admits a request.
    ///
    /// # Errors
    /// [`AdmitError`] when the request can never run.
    pub fn add_request(&mut self, r: NewRequest) -> Result<(), AdmitError> {
        self.sched.add_request(r)
    }

    /// Cancels a request; its acknowledgement is pushed to `events`.
    pub fn cancel(&mut self, id: RequestId, events: &mut Vec<Event>) {
        self.sched.cancel(id, events)
    }

    /// True when no request is live and nothing is in flight.
    pub fn is_idle(&self) -> bool {
        self.sched.is_idle() && self.published.is_empty() && self.submitted.is_empty()
    }

    /// One step: publish launches up to the in-flight limit, submit them to a backend that
    /// keeps launches in flight, then finish the oldest (or execute it through its fence),
    /// accept its completion and report it released. Returns `false` when there was nothing
    /// to do.
    ///
    /// # Errors
    /// A backend failure.
    pub fn step(&mut self, events: &mut Vec<Event>) -> Result<bool, WorkerError> {
        while let Some(l) = self.sched.schedule() {
            self.published.push_back(l);
        }
        let depth = self.backend.max_in_flight();
        while depth > 1 && self.submitted.len() < depth {
            let Some(l) = self.published.front() else {
                break;
            };
            if !self.backend.submit(l, self.sched.tables().as_ref())? {
                break; // runs through `execute` once the launches ahead have finished
            }
            self.submitted.extend(self.published.pop_front());
        }
        if let Some(launch) = self.submitted.pop_front() {
            let (seq, completion) = self.backend.finish().ok_or_else(|| {
                WorkerError::Device(format!("launch {} was lost in flight", launch.seq))
            })?;
            if seq != launch.seq {
                return Err(WorkerError::Device(format!(
                    "launch {seq} finished while launch {} was the oldest in flight",
                    launch.seq
                )));
            }
            self.sched.on_completion(&completion?, events);
            self.sched.on_released(launch.seq);
            return Ok(true);
        }
        let Some(launch) = self.published.pop_front() else {
            return Ok(false);
        };
        let completion = self
            .backend
            .execute(&launch, self.sched.tables().as_ref())?;
        self.sched.on_completion(&completion, events);
        self.sched.on_released(launch.seq);
        Ok(true)
    }

    /// Steps until every request has finished, collecting events.
    ///
    /// # Errors
    /// A backend failure.
    pub fn run_until_idle(&mut self, events: &mut Vec<Event>) -> Result<(), WorkerError> {
        while !self.is_idle() {
            if !self.step(events)? {
                // Nothing publishable and nothing in flight while requests are live cannot
                // happen (admission refuses requests that can never fit); guard anyway.
                if self.published.is_empty()
                    && !self.sched.is_idle()
                    && self.sched.stats().inflight == 0
                {
                    return Err(WorkerError::Device(
                        "scheduler stalled with live requests and nothing in flight".into(),
                    ));
                }
            }
        }
        Ok(())
    }
}
