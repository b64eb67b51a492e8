// The launch trace's clock (kernels/common.cuh, baton_cuda::trace): how coarse %globaltimer is
// on this device. One thread reads it until it has changed `changes` times (or 2^26 reads);
// out[0] = the smallest difference between consecutive distinct readings (ns; ~0 when it never
// changed), out[1] = the readings taken. Some GPUs step it by about a microsecond unless a
// profiler raised its rate, which quantizes every time the trace reports; the worker runs this
// once when the trace is on and the report prints the tick.
// Launch: grid = (1), block = (32).
BATON_ENTRY void baton_trace_tick(u64* __restrict__ out, int changes) {
    BATON_TRACE_SCOPE();
    BATON_PDL_WAIT();
    BATON_PDL_LAUNCH();
    if (threadIdx.x != 0) return;
    u64 prev = baton_globaltimer(), best = ~0ull, reads = 1;
    for (int c = 0; c < changes && reads < (1ull << 26);) {
        const u64 t = baton_globaltimer();
        ++reads;
        if (t != prev) {
            if (t - prev < best) best = t - prev;
            prev = t;
            ++c;
        }
    }
    out[0] = best;
    out[1] = reads;
}
