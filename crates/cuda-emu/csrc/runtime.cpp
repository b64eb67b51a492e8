// The emulator's scheduler: runs one CUDA thread block as cooperative fibers on the calling OS
// thread, blocks one after another. See src/lib.rs for the model and its limits.
//
// A fiber runs until it finishes or reaches a barrier (__syncthreads or a warp shuffle); it
// then records where it waits and switches straight to the next ready fiber. The last fiber to
// arrive at a barrier releases the waiters, queued in thread order, reverse thread order, a
// seeded shuffle, or ahead of every other ready fiber (the launch's schedule; a kernel whose
// result depends on it has a race). Control returns to the scheduler loop only when no fiber is
// ready: then either every thread finished, or the block is deadlocked and the launch fails.
// Before each block, shared memory (the section `baton_emu_shared`, see build.rs) is filled
// with 0xff bytes.
#include "prelude.h"
#include "runtime.h"

#include <stdarg.h>
#include <stdio.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <string>
#include <vector>

#if defined(__x86_64__) && !defined(BATON_EMU_UCONTEXT)
#define BATON_EMU_ASM_SWITCH 1
#else
#include <ucontext.h>
#endif

namespace baton_emu {

Coords g_coords;
unsigned long long g_trace_buf = 0;
unsigned long long g_gridid = 0;

unsigned long long globaltimer() {
    return (unsigned long long)std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
}

namespace {

constexpr size_t kStackBytes = 128 * 1024;
constexpr size_t kGuardBytes = 4096;
constexpr unsigned kWarp = 32;

// ---- Execution contexts ------------------------------------------------------------------------
#if BATON_EMU_ASM_SWITCH
// Saved stack pointer; the callee-saved registers, MXCSR and the x87 control word live on the
// fiber's own stack (System V x86-64 ABI).
struct Ctx {
    void* sp = nullptr;
};
#else
struct Ctx {
    ucontext_t uc;
};
#endif

}  // namespace
}  // namespace baton_emu

#if BATON_EMU_ASM_SWITCH
extern "C" void baton_emu_ctx_switch(void** save_sp, void* load_sp);
extern "C" void baton_emu_fiber_entry();
asm(R"(
    .text
    .p2align 4
    .globl baton_emu_ctx_switch
    .hidden baton_emu_ctx_switch
    .type baton_emu_ctx_switch, @function
baton_emu_ctx_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $16, %rsp
    stmxcsr 8(%rsp)
    fnstcw 12(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr 8(%rsp)
    fldcw 12(%rsp)
    addq $16, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size baton_emu_ctx_switch, .-baton_emu_ctx_switch

    .p2align 4
    .globl baton_emu_fiber_entry
    .hidden baton_emu_fiber_entry
    .type baton_emu_fiber_entry, @function
baton_emu_fiber_entry:
    call baton_emu_fiber_main@PLT
    ud2
    .size baton_emu_fiber_entry, .-baton_emu_fiber_entry
)");
#endif

extern "C" __attribute__((visibility("hidden"), used, noreturn)) void baton_emu_fiber_main();

// Bounds of every kernel's __shared__ variables (the linker defines them for a section whose name
// is a C identifier).
extern "C" unsigned char __start_baton_emu_shared[];
extern "C" unsigned char __stop_baton_emu_shared[];

namespace baton_emu {
namespace {

void ctx_switch(Ctx* from, Ctx* to) {
#if BATON_EMU_ASM_SWITCH
    baton_emu_ctx_switch(&from->sp, to->sp);
#else
    swapcontext(&from->uc, &to->uc);
#endif
}

// A fresh context that starts baton_emu_fiber_main on [lo, lo + len).
void ctx_init(Ctx* c, unsigned char* lo, size_t len) {
#if BATON_EMU_ASM_SWITCH
    uintptr_t top = ((uintptr_t)lo + len) & ~(uintptr_t)15;
    // Frame popped by baton_emu_ctx_switch: [16 bytes: MXCSR at +8, x87 CW at +12], r15, r14,
    // r13, r12, rbx, rbp, return address. After `ret` the stack pointer is top - 16 (16-byte
    // aligned), so the `call` in baton_emu_fiber_entry enters the C++ code with the ABI's
    // alignment.
    unsigned char* sp = (unsigned char*)(top - 88);
    memset(sp, 0, 88);
    const uint32_t mxcsr = 0x1F80;  // all exceptions masked, round to nearest
    const uint16_t fpucw = 0x037F;
    memcpy(sp + 8, &mxcsr, 4);
    memcpy(sp + 12, &fpucw, 2);
    void (*entry)() = &baton_emu_fiber_entry;
    memcpy(sp + 64, &entry, 8);
    c->sp = sp;
#else
    getcontext(&c->uc);
    c->uc.uc_stack.ss_sp = lo;
    c->uc.uc_stack.ss_size = len;
    c->uc.uc_link = nullptr;
    makecontext(&c->uc, (void (*)())baton_emu_fiber_main, 0);
#endif
}

// ---- Block state -------------------------------------------------------------------------------
enum class St : unsigned char { Ready, AtBlock, AtWarp, AtGrid, Done };

struct Site {
    const char* file = nullptr;
    int line = 0;
};

bool same_site(const Site& a, const Site& b) {
    return a.line == b.line && (a.file == b.file || strcmp(a.file, b.file) == 0);
}

const char* base_name(const char* path) {
    const char* s = strrchr(path, '/');
    return s ? s + 1 : path;
}

struct Fiber {
    Ctx ctx;
    uint3 tid;
    St st = St::Ready;
    Site site;                // where it waits (St::AtBlock / St::AtWarp)
    unsigned shfl_count = 0;  // shuffles completed; parity picks the exchange buffer
    int lane_mask = 0;        // arguments of the pending shuffle
    unsigned size = 0;
    // cp.async copies issued and not yet performed, each tagged with its group (the number of
    // commits before it); `groups` counts this thread's commits.
    struct CpAsync {
        void* dst;
        const void* src;
        unsigned group;
        unsigned char data[16];  // the source as it was when the copy was issued
    };
    std::vector<CpAsync> cp_async;
    unsigned groups = 0;
};

struct Warp {
    unsigned size = 0, live = 0, arrived = 0;
    // Double-buffered exchange slots: a lane cannot reach shuffle k + 2 (which reuses shuffle
    // k's buffer) before every lane has arrived at shuffle k + 1, i.e. has read shuffle k.
    unsigned long long buf[2][kWarp];
};

// Order in which released (or starting) fibers are queued.
enum Schedule : int { kInOrder = 0, kReverse = 1, kShuffled = 2, kRunAhead = 3 };

struct Run {
    int schedule = kInOrder;
    unsigned long long rng = 0;  // kShuffled: splitmix64 state
    std::vector<unsigned> released;
    const Entry* entry = nullptr;
    void** args = nullptr;
    unsigned n = 0;
    std::vector<Fiber> fibers;
    std::vector<Warp> warps;
    std::vector<unsigned> ready;  // ring of n slots: a fiber is queued at most once
    unsigned head = 0, queued = 0;
    unsigned live = 0, arrived = 0;
    unsigned at_grid = 0;     // threads waiting at the grid barrier (cooperative launches)
    unsigned stack_base = 0;  // this block's first stack in g_stacks
    bool cooperative = false;
    unsigned cur = 0;
    Ctx sched;
    int code = 0;  // BATON_EMU_* of the first failure in this block
    std::string msg;
};

// The block that runs now: g_single for ordinary launches (blocks run one after another and
// reuse it), one Run per block of a cooperative launch (blocks are parked at grid barriers).
Run g_single;
Run* g_cur = &g_single;
std::vector<unsigned char*> g_stacks;  // each: guard page, then kStackBytes of stack
std::atomic<bool> g_busy{false};

bool ensure_stacks(unsigned n) {
    while (g_stacks.size() < n) {
        void* p = mmap(nullptr, kGuardBytes + kStackBytes, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_STACK, -1, 0);
        if (p == MAP_FAILED) return false;
        // A stack overflow faults on the guard page instead of corrupting the next stack.
        mprotect(p, kGuardBytes, PROT_NONE);
        g_stacks.push_back((unsigned char*)p + kGuardBytes);
    }
    return true;
}

void push_ready(Run& r, unsigned i) {
    r.ready[(r.head + r.queued) % r.n] = i;
    ++r.queued;
    r.fibers[i].st = St::Ready;
}

unsigned long long splitmix64(unsigned long long& s) {
    unsigned long long z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// Queues r.released (ascending thread ids) in the launch's schedule order.
void release_all(Run& r) {
    std::vector<unsigned>& v = r.released;
    if (r.schedule == kReverse) {
        std::reverse(v.begin(), v.end());
    } else if (r.schedule == kShuffled) {
        for (size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[splitmix64(r.rng) % i]);
    }
    if (r.schedule == kRunAhead) {
        // Released fibers go to the front of the queue, in thread order: the warp (or block)
        // just released keeps running while the others wait.
        for (size_t k = v.size(); k-- > 0;) {
            r.head = (r.head + r.n - 1) % r.n;
            r.ready[r.head] = v[k];
            ++r.queued;
            r.fibers[v[k]].st = St::Ready;
        }
    } else {
        for (unsigned i : v) push_ready(r, i);
    }
    v.clear();
}

void set_failure(Run& r, int code, const std::string& msg) {
    if (r.code == 0) {
        r.code = code;
        r.msg = msg;
    }
}

std::string fmt(const char* f, ...) __attribute__((format(printf, 1, 2)));
std::string fmt(const char* f, ...) {
    char buf[512];
    va_list ap;
    va_start(ap, f);
    vsnprintf(buf, sizeof buf, f, ap);
    va_end(ap);
    return buf;
}

// "N at file:line, M at file:line" over the fibers in state `st` (optionally one warp).
std::string describe_sites(const Run& r, St st, unsigned lo, unsigned hi) {
    std::vector<std::pair<Site, unsigned>> sites;
    for (unsigned i = lo; i < hi; ++i) {
        const Fiber& f = r.fibers[i];
        if (f.st != st) continue;
        bool found = false;
        for (auto& s : sites)
            if (same_site(s.first, f.site)) {
                ++s.second;
                found = true;
                break;
            }
        if (!found) sites.push_back({f.site, 1});
    }
    std::string out;
    for (auto& s : sites) {
        if (!out.empty()) out += ", ";
        out += fmt("%u at %s:%d", s.second, base_name(s.first.file), s.first.line);
    }
    return out;
}

// Queues the threads waiting in state `st` (__syncthreads or the grid barrier, `what`), which
// must all wait at the same textual barrier; false (and a divergence failure) when they do not.
bool release_waiting(Run& r, St st, const char* what) {
    const Fiber* first = nullptr;
    for (unsigned i = 0; i < r.n; ++i) {
        const Fiber& f = r.fibers[i];
        if (f.st != st) continue;
        if (!first) {
            first = &f;
        } else if (!same_site(first->site, f.site)) {
            set_failure(r, 2,
                        fmt("divergent %s: the threads of the block wait at different barriers (",
                            what) +
                            describe_sites(r, st, 0, r.n) + ")");
            return false;
        }
    }
    for (unsigned i = 0; i < r.n; ++i)
        if (r.fibers[i].st == st) r.released.push_back(i);
    release_all(r);
    return true;
}

void release_block(Run& r) {
    if (release_waiting(r, St::AtBlock, "__syncthreads")) r.arrived = 0;
}

void release_warp(Run& r, unsigned wi) {
    Warp& w = r.warps[wi];
    const unsigned lo = wi * kWarp, hi = lo + w.size;
    if (w.size != kWarp || w.live != kWarp) {
        set_failure(r, 2,
                    fmt("__shfl_xor_sync with the full mask in warp %u, which has %u live threads "
                        "of %u (a partner lane does not exist or has exited): %s",
                        wi, w.live, w.size, describe_sites(r, St::AtWarp, lo, hi).c_str()));
        return;
    }
    const Fiber& f0 = r.fibers[lo];
    for (unsigned i = lo + 1; i < hi; ++i) {
        const Fiber& f = r.fibers[i];
        if (!same_site(f.site, f0.site) || f.lane_mask != f0.lane_mask || f.size != f0.size ||
            (f.shfl_count & 1) != (f0.shfl_count & 1)) {
            set_failure(r, 2,
                        fmt("divergent __shfl_xor_sync in warp %u: lane 0 exchanges %u bytes "
                            "with laneMask %d at %s:%d (shuffle #%u), lane %u %u bytes with "
                            "laneMask %d at %s:%d (shuffle #%u)",
                            wi, f0.size, f0.lane_mask, base_name(f0.site.file), f0.site.line,
                            f0.shfl_count, i - lo, f.size, f.lane_mask, base_name(f.site.file),
                            f.site.line, f.shfl_count));
            return;
        }
    }
    w.arrived = 0;
    for (unsigned i = lo; i < hi; ++i) r.released.push_back(i);
    release_all(r);
}

// Takes the next fiber off the ready queue and makes it current.
unsigned pop_ready(Run& r) {
    const unsigned i = r.ready[r.head];
    r.head = (r.head + 1) % r.n;
    --r.queued;
    r.cur = i;
    g_coords.thread_idx = r.fibers[i].tid;
    return i;
}

// Leaves fiber `f` (waiting or finished) for the next ready fiber, directly (no detour through
// the scheduler), or for the scheduler when none is ready or the block failed. Returns when `f`
// is resumed.
void switch_away(Run& r, Fiber& f) {
    if (r.code != 0 || r.queued == 0) {
        ctx_switch(&f.ctx, &r.sched);
        return;
    }
    Fiber& next = r.fibers[pop_ready(r)];
    if (&next != &f) ctx_switch(&f.ctx, &next.ctx);  // else: f released itself and runs on
}

[[noreturn]] void fail_here(Run& r, Fiber& f, const std::string& msg) {
    set_failure(r, 2, msg);
    switch_away(r, f);  // the scheduler never resumes a block that failed
    __builtin_trap();
}

}  // namespace

// cp.async as the GPU may perform it: the global read happens at some point between the issue
// and the wait that covers the copy's group, the shared-memory write by that wait. So here the
// destination is written only at the wait (a kernel that writes it in between, or reads it
// before its wait and barrier, sees the difference), and a source that changed in between is
// a failure (the GPU may have read either value).
void cp_async16(void* dst, const void* src) {
    Fiber& f = g_cur->fibers[g_cur->cur];
    Fiber::CpAsync c{dst, src, f.groups, {}};
    memcpy(c.data, src, 16);
    f.cp_async.push_back(c);
}

void cp_async_commit() { ++g_cur->fibers[g_cur->cur].groups; }

void cp_async_wait(int pending) {
    Fiber& f = g_cur->fibers[g_cur->cur];
    // Committed groups older than the newest `pending` complete; uncommitted copies do not.
    const unsigned done = f.groups > (unsigned)pending ? f.groups - (unsigned)pending : 0;
    size_t kept = 0;
    for (const Fiber::CpAsync& c : f.cp_async) {
        if (c.group >= done) {
            f.cp_async[kept++] = c;
            continue;
        }
        if (memcmp(c.data, c.src, 16) != 0)
            fail_here(*g_cur, f,
                      fmt("thread (%u, %u, %u): the source of a cp.async changed before the "
                          "wait for it (a race on the GPU)",
                          f.tid.x, f.tid.y, f.tid.z));
        memcpy(c.dst, c.data, 16);
    }
    f.cp_async.resize(kept);
}

namespace {

size_t shared_bytes() { return (size_t)(__stop_baton_emu_shared - __start_baton_emu_shared); }

// Resets block `r` (fresh fibers, every thread ready; shared memory poisoned) without running it.
void init_block(Run& r, unsigned long long seed, unsigned long long block_linear) {
    memset(__start_baton_emu_shared, 0xff, shared_bytes());
    r.rng = seed ^ (block_linear * 0xD1B54A32D192ED03ull);
    r.code = 0;
    r.msg.clear();
    r.live = r.n;
    r.arrived = 0;
    r.head = 0;
    r.queued = 0;
    const dim3 bd = g_coords.block_dim;
    for (unsigned i = 0; i < r.n; ++i) {
        Fiber& f = r.fibers[i];
        f.tid = uint3{i % bd.x, (i / bd.x) % bd.y, i / (bd.x * bd.y)};
        f.shfl_count = 0;
        f.site = Site{};
        f.cp_async.clear();
        f.groups = 0;
        ctx_init(&f.ctx, g_stacks[r.stack_base + i], kStackBytes);
        r.released.push_back(i);
    }
    release_all(r);
    for (unsigned w = 0; w < r.warps.size(); ++w) {
        Warp& wp = r.warps[w];
        wp.size = std::min(kWarp, r.n - w * kWarp);
        wp.live = wp.size;
        wp.arrived = 0;
    }
    r.at_grid = 0;
}

// Runs the ready fibers of block `r` until none is ready, then classifies what is left: every
// thread finished, every live thread waits at the grid barrier (cooperative launches; the caller
// resumes the block once every block has arrived), or a failure in r.code.
void resume_block(Run& r) {
    // Fibers hand over to each other; control comes back here when the block failed, finished,
    // or has no ready fiber left.
    const unsigned first = pop_ready(r);
    ctx_switch(&r.sched, &r.fibers[first].ctx);
    if (r.code != 0) return;
    if (r.live > 0 && r.at_grid == r.live) return;
    if (r.live > 0) {
        std::string warps;
        for (unsigned w = 0; w < r.warps.size(); ++w)
            if (r.warps[w].arrived > 0) {
                if (!warps.empty()) warps += ", ";
                warps += fmt("%u", w);
            }
        std::string msg = fmt("deadlock: %u of %u threads unfinished and none can run", r.live, r.n);
        if (r.arrived > 0)
            msg += "; at __syncthreads: " + describe_sites(r, St::AtBlock, 0, r.n);
        if (!warps.empty())
            msg += "; at __shfl_xor_sync (warps " + warps +
                   "): " + describe_sites(r, St::AtWarp, 0, r.n);
        if (r.at_grid > 0)
            msg += "; at the grid barrier: " + describe_sites(r, St::AtGrid, 0, r.n);
        set_failure(r, 1, msg);
    }
}

void run_block(Run& r, unsigned long long seed, unsigned long long block_linear) {
    init_block(r, seed, block_linear);
    resume_block(r);
}

// Releases the threads of a block parked at the grid barrier (all at the same textual barrier,
// as for __syncthreads) and runs them.
void release_grid(Run& r) {
    if (!release_waiting(r, St::AtGrid, "grid barrier")) return;
    r.at_grid = 0;
    resume_block(r);
}

}  // namespace

void syncthreads_at(const char* file, int line) {
    Run& r = *g_cur;
    Fiber& f = r.fibers[r.cur];
    f.st = St::AtBlock;
    f.site = Site{file, line};
    if (++r.arrived == r.live) release_block(r);
    switch_away(r, f);
}

void grid_sync_at(const char* file, int line) {
    Run& r = *g_cur;
    Fiber& f = r.fibers[r.cur];
    if (!r.cooperative)
        fail_here(r, f,
                  fmt("grid barrier at %s:%d in a launch that is not cooperative (its blocks "
                      "need not be resident together)",
                      base_name(file), line));
    f.st = St::AtGrid;
    f.site = Site{file, line};
    ++r.at_grid;
    switch_away(r, f);
}

void shfl_xor_at(const char* file, int line, const void* in, void* out, unsigned size,
                 unsigned mask, int lane_mask, int width) {
    Run& r = *g_cur;
    const unsigned i = r.cur;
    Fiber& f = r.fibers[i];
    const unsigned lane = i % kWarp;
    Warp& w = r.warps[i / kWarp];
    if (mask != 0xffffffffu)
        fail_here(r, f,
                  fmt("__shfl_xor_sync at %s:%d with mask 0x%08x: the emulator models only the "
                      "full mask",
                      base_name(file), line, mask));
    if (width != (int)kWarp || lane_mask < 0 || lane_mask >= (int)kWarp)
        fail_here(r, f,
                  fmt("__shfl_xor_sync at %s:%d with laneMask %d, width %d: the emulator "
                      "models laneMask in [0, 32) and width 32 only",
                      base_name(file), line, lane_mask, width));
    const unsigned phase = f.shfl_count & 1;
    memcpy(&w.buf[phase][lane], in, size);
    f.site = Site{file, line};
    f.lane_mask = lane_mask;
    f.size = size;
    f.st = St::AtWarp;
    if (++w.arrived == w.live) release_warp(r, i / kWarp);
    switch_away(r, f);
    memcpy(out, &w.buf[phase][lane ^ (unsigned)lane_mask], size);
    ++f.shfl_count;
}

}  // namespace baton_emu

extern "C" void baton_emu_fiber_main() {
    using namespace baton_emu;
    Run& r = *g_cur;
    const unsigned i = r.cur;
    r.entry->invoke(r.args);
    Fiber& f = r.fibers[i];
    if (!f.cp_async.empty())
        set_failure(r, 2,
                    fmt("thread (%u, %u, %u) exited with %zu cp.async copies it never waited for",
                        f.tid.x, f.tid.y, f.tid.z, f.cp_async.size()));
    f.st = St::Done;
    --r.live;
    Warp& w = r.warps[i / kWarp];
    --w.live;
    if (r.arrived > 0 && r.arrived == r.live) release_block(r);
    if (w.arrived > 0 && w.arrived == w.live) release_warp(r, i / kWarp);
    switch_away(r, f);
    __builtin_trap();  // a finished fiber is never resumed
}

namespace baton_emu {
namespace {

uint3 block_coords(unsigned long long b, const unsigned grid[3]) {
    return uint3{(unsigned)(b % grid[0]), (unsigned)((b / grid[0]) % grid[1]),
                 (unsigned)(b / ((unsigned long long)grid[0] * grid[1]))};
}

// Sets `r` up for `n` threads of the launch's entry.
void prepare_run(Run& r, const Entry* entry, void** args, int schedule, unsigned n,
                 unsigned stack_base, bool cooperative) {
    r.schedule = schedule;
    r.entry = entry;
    r.args = args;
    r.n = n;
    r.stack_base = stack_base;
    r.cooperative = cooperative;
    r.fibers.resize(n);
    r.warps.resize((n + kWarp - 1) / kWarp);
    r.ready.assign(n, 0);
}

// A cooperative launch: every block's fibers stay alive across grid barriers. Each round runs
// every unfinished block, in `order`, until it finishes or all its live threads wait at the
// grid barrier; a parked block's shared memory is saved and restored around the other blocks'
// turns. When a round ends with every block parked, the next round releases them. A block that
// finishes while others wait at a barrier would hang the GPU (the barrier counts every block of
// the grid), so that is reported as a deadlock. Returns the failing block's index in `bad`.
int run_cooperative(const Entry* entry, const unsigned grid[3], void** args, int schedule,
                    unsigned long long seed, unsigned n,
                    const std::vector<unsigned long long>& order, std::string& msg,
                    uint3& bad) {
    const size_t nblocks = order.size();
    if (!ensure_stacks((unsigned)(n * nblocks))) {
        msg = fmt("cannot map stacks for %zu blocks of %u threads", nblocks, n);
        return 3;
    }
    std::vector<Run> blocks(nblocks);
    std::vector<std::vector<unsigned char>> saved(nblocks);
    std::vector<unsigned char> state(nblocks, 0);  // 0 not started, 1 parked, 2 finished
    for (size_t b = 0; b < nblocks; ++b)
        prepare_run(blocks[b], entry, args, schedule, n, (unsigned)(b * n), true);
    for (unsigned round = 0;; ++round) {
        for (unsigned long long b : order) {
            if (state[b] == 2) continue;
            Run& r = blocks[b];
            g_cur = &r;
            g_coords.block_idx = block_coords(b, grid);
            if (state[b] == 0) {
                run_block(r, seed, b);
            } else {
                memcpy(__start_baton_emu_shared, saved[b].data(), shared_bytes());
                release_grid(r);
            }
            if (r.code != 0) {
                msg = r.msg;
                bad = g_coords.block_idx;
                return r.code;
            }
            if (r.live == 0) {
                state[b] = 2;
                saved[b].clear();
            } else {
                state[b] = 1;
                saved[b].assign(__start_baton_emu_shared,
                                __start_baton_emu_shared + shared_bytes());
            }
        }
        size_t parked = 0;
        unsigned long long done = nblocks;
        for (size_t b = 0; b < nblocks; ++b) {
            if (state[b] == 1) ++parked;
            if (state[b] == 2 && done == nblocks) done = b;
        }
        if (parked == 0) return 0;
        if (done != nblocks) {
            bad = block_coords(done, grid);
            msg = fmt("deadlock: the block finished while %zu of %zu blocks wait at the grid "
                      "barrier (round %u; a grid barrier needs every block of the grid)",
                      parked, nblocks, round);
            for (size_t b = 0; b < nblocks; ++b)
                if (state[b] == 1) {
                    msg += " at " + describe_sites(blocks[b], St::AtGrid, 0, blocks[b].n);
                    break;
                }
            return 1;
        }
    }
}

}  // namespace
}  // namespace baton_emu

// The launch trace's table and launch number for the next launch (common.cuh); the Rust side
// sets them under its launch lock.
extern "C" void baton_emu_set_trace(unsigned long long table, unsigned long long grid) {
    baton_emu::g_trace_buf = table;
    baton_emu::g_gridid = grid;
}

// Runs `entry` over the grid, queueing fibers per `schedule` (0 thread order, 1 reverse, 2
// shuffled with `seed`, 3 released fibers first). Blocks run one after another, or, when
// `cooperative`, interleaved at grid barriers (run_cooperative). Returns 0, or 1 (deadlock) / 2
// (divergence or unsupported barrier use) / 3 (resource failure) with a NUL-terminated message
// in err[0..cap) and the failing block's index in bad_block[3]. Callers validate grid, block and
// argument count; launches must not overlap (the Rust side holds a mutex).
extern "C" int baton_emu_run(const baton_emu::Entry* entry, const unsigned grid[3],
                             const unsigned block[3], void** args, int schedule,
                             unsigned long long seed, int cooperative, char* err, size_t cap,
                             unsigned bad_block[3]) {
    using namespace baton_emu;
    auto report = [&](int code, const std::string& msg) {
        if (cap > 0) snprintf(err, cap, "%s", msg.c_str());
        return code;
    };
    if (g_busy.exchange(true)) return report(3, "overlapping launches (missing lock)");
    Run& r = g_single;
    g_cur = &g_single;
    const unsigned n = block[0] * block[1] * block[2];
    if (n == 0 || n > 1024 || !ensure_stacks(n)) {
        g_busy = false;
        return report(3, fmt("cannot run a block of %u threads", n));
    }
    prepare_run(r, entry, args, schedule, n, 0, false);
    g_coords.block_dim = dim3(block[0], block[1], block[2]);
    g_coords.grid_dim = dim3(grid[0], grid[1], grid[2]);
    // Blocks run one after another, in linear order, or reversed / shuffled with the thread
    // schedule: a kernel whose blocks hand work to the one that finishes last (split-K
    // combines) must give the same result whichever block that is.
    const unsigned long long nblocks =
        (unsigned long long)grid[0] * grid[1] * (unsigned long long)grid[2];
    std::vector<unsigned long long> order(nblocks);
    for (unsigned long long i = 0; i < nblocks; ++i) order[i] = i;
    if (schedule == kReverse) {
        std::reverse(order.begin(), order.end());
    } else if (schedule == kShuffled) {
        unsigned long long s = seed ^ 0xB10C0BDE5EEDull;
        for (size_t i = order.size(); i > 1; --i) std::swap(order[i - 1], order[splitmix64(s) % i]);
    }
    int code = 0;
    if (cooperative) {
        std::string msg;
        uint3 bad{0, 0, 0};
        code = run_cooperative(entry, grid, args, schedule, seed, n, order, msg, bad);
        g_cur = &g_single;
        if (code != 0) {
            report(code, msg);
            bad_block[0] = bad.x;
            bad_block[1] = bad.y;
            bad_block[2] = bad.z;
        }
        g_busy = false;
        return code;
    }
    for (unsigned long long b : order) {
        g_coords.block_idx = block_coords(b, grid);
        run_block(r, seed, b);
        if (r.code != 0) {
            code = report(r.code, r.msg);
            bad_block[0] = g_coords.block_idx.x;
            bad_block[1] = g_coords.block_idx.y;
            bad_block[2] = g_coords.block_idx.z;
            break;
        }
    }
    g_busy = false;
    return code;
}
