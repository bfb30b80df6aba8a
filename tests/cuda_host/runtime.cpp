// The emulator's runtime: fibers for CUDA threads, the scheduler that runs a block's threads
// between rendezvous points, barrier and warp-shuffle semantics with their error checks, and
// the launch loop (blocks shared among OS worker threads). Built once into libcuda_host.so,
// which every kernel module links; see shim.h for what is emulated.
//
// A block runs in passes: each pass resumes every runnable thread, in the launch's order
// (in order, reversed, or shuffled with a seed), until it blocks at __syncthreads or a warp
// operation, or returns. A warp operation completes when the last lane of its mask arrives;
// a barrier when every live thread waits at it. A pass in which nothing can run is a
// deadlock and is reported with what each group of threads waits for.
//
// Faults (SIGSEGV at a guard page after an argument buffer, SIGBUS, SIGFPE, SIGILL) inside a
// kernel are caught on the worker thread, which abandons the launch and returns the address;
// emulator.py names the argument. Under AddressSanitizer its own reports take over instead.
#include "shim.h"

#include <link.h>
#include <setjmp.h>
#include <signal.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <atomic>
#include <cstdarg>
#include <cstdio>
#include <mutex>
#include <thread>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define CUDA_HOST_ASAN 1
constexpr size_t STACK_BYTES = 512 * 1024;  // ASan's redzones make frames larger
#else
#define CUDA_HOST_ASAN 0
constexpr size_t STACK_BYTES = 64 * 1024;
#endif

#if !defined(__x86_64__)
#error "cuda_host fibers switch stacks with x86-64 code"
#endif

// Save callee-saved registers on the current stack, store the stack pointer in *from, load
// `to` and restore the registers saved there: the System V x86-64 ABI keeps everything else
// caller-saved, so this is a whole context switch.
extern "C" void cuda_host_switch(void** from, void* to);
// First code a new fiber runs: its Fiber* waits in rbx (see start_fiber).
extern "C" void cuda_host_fiber_start();
asm(R"(
    .text
    .globl cuda_host_switch
    .type cuda_host_switch, @function
cuda_host_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size cuda_host_switch, .-cuda_host_switch

    .globl cuda_host_fiber_start
    .type cuda_host_fiber_start, @function
cuda_host_fiber_start:
    movq %rbx, %rdi
    andq $-16, %rsp
    call cuda_host_fiber_main
    ud2
    .size cuda_host_fiber_start, .-cuda_host_fiber_start
)");

namespace cuda_host {

thread_local const Builtins* current;

namespace {

enum State { RUNNABLE, AT_BARRIER, AT_WARP, EXITED };

struct Site {
    const char* file = "";
    int line = 0;
    // The same line of one module passes the same literal: most comparisons need no strcmp.
    bool operator==(const Site& o) const {
        return line == o.line && (file == o.file || std::strcmp(file, o.file) == 0);
    }
};

struct WarpCall {  // one lane's arguments to a warp operation, and its result
    ShuffleMode mode;
    unsigned mask;
    unsigned long long value;
    int arg, width;
    Site site;
};

struct Worker;

struct Fiber {
    Builtins builtins;
    int tid, warp, lane;  // linear thread id in the block
    State state;
    Site site;            // where it waits
    WarpCall call;
    void* sp;             // saved stack pointer while switched out
    char* stack;          // STACK_BYTES, with a guard page below
    Worker* worker;
};

struct Warp {
    unsigned present;  // lanes that exist (the last warp may be partial)
    unsigned exited;
    unsigned waiting;  // lanes at a warp operation
};

struct Launch {
    const Module* module;
    const Kernel* kernel;
    dim3 grid, block;
    unsigned long long shared_bytes;
    int order;
    unsigned long long seed;
    unsigned char poison;
    bool ftz;
    void* const* args;
    std::atomic<long long> next_block{0};
    std::atomic<bool> failed{false};
    std::mutex error_lock;
    int status = 0;
    unsigned long long fault_addr = 0;
    int fault_write = 0;
    char message[2048] = "";
};

struct Worker {
    Launch* launch = nullptr;
    std::vector<Fiber> fibers;
    std::vector<Warp> warps;
    std::vector<int> order;
    Fiber* running = nullptr;
    void* scheduler_sp = nullptr;
    int live = 0, at_barrier = 0;
    bool failed = false;
    char* tls = nullptr;  // this thread's copy of the module's __shared__ variables
    size_t tls_bytes = 0;
    uint3 block_idx;
    sigjmp_buf fault_jump;
#if CUDA_HOST_ASAN
    void* fake_stack = nullptr;
    const void* os_stack_bottom = nullptr;
    size_t os_stack_size = 0;
#endif
};

thread_local Worker* this_worker;

// --------------------------------------------------------------- reporting

// Records the launch's first error (later ones from other workers are dropped).
void report(Launch& l, int status, const char* fmt, ...) {
    std::lock_guard<std::mutex> guard(l.error_lock);
    if (l.failed.exchange(true)) return;
    l.status = status;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(l.message, sizeof l.message, fmt, ap);
    va_end(ap);
}

const char* base_name(const char* path) {
    const char* slash = std::strrchr(path, '/');
    return slash ? slash + 1 : path;
}

// "threads 0-31, 64" from a predicate over thread ids.
template <typename Pred>
std::string thread_ranges(const Worker& w, Pred pred) {
    std::string s;
    const int n = (int)w.fibers.size();
    for (int i = 0; i < n;) {
        if (!pred(w.fibers[i])) { i++; continue; }
        int j = i;
        while (j + 1 < n && pred(w.fibers[j + 1])) j++;
        if (!s.empty()) s += ", ";
        s += std::to_string(i) + (j > i ? "-" + std::to_string(j) : "");
        i = j + 1;
    }
    return s;
}

const char* mode_name(ShuffleMode m) {
    static const char* names[] = {"__shfl_sync", "__shfl_up_sync", "__shfl_down_sync",
                                  "__shfl_xor_sync", "__syncwarp"};
    return names[m];
}

std::string where(const Site& s) { return std::string(base_name(s.file)) + ":" + std::to_string(s.line); }

// What every waiting thread waits for, grouped: the text of a deadlock or divergence report.
std::string waiting_summary(const Worker& w) {
    std::string s;
    std::vector<bool> done(w.fibers.size());
    for (size_t i = 0; i < w.fibers.size(); i++) {
        if (done[i]) continue;
        const Fiber& f = w.fibers[i];
        auto same = [&](const Fiber& g) {
            if (g.state != f.state) return false;
            if (g.state == AT_BARRIER) return g.site == f.site;
            if (g.state == AT_WARP) return g.call.site == f.call.site && g.call.mask == f.call.mask;
            return true;
        };
        for (size_t j = i; j < w.fibers.size(); j++) done[j] = done[j] || same(w.fibers[j]);
        std::string what;
        char mask[32];
        switch (f.state) {
            case EXITED: what = "returned"; break;
            case RUNNABLE: what = "runnable"; break;
            case AT_BARRIER: what = "wait at __syncthreads (" + where(f.site) + ")"; break;
            case AT_WARP:
                snprintf(mask, sizeof mask, "0x%08x", f.call.mask);
                what = std::string("wait at ") + mode_name(f.call.mode) + " (" + where(f.call.site) +
                       ", mask " + mask + ")";
                break;
        }
        s += "\n  threads " + thread_ranges(w, same) + ": " + what;
    }
    return s;
}

void yield(Worker& w, bool exiting = false);

// Called on a fiber: record the error and leave the block for good.
[[noreturn]] void fail(Worker& w, const char* fmt, ...) {
    char text[1536];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof text, fmt, ap);
    va_end(ap);
    const uint3 b = w.block_idx;
    report(*w.launch, 1, "block (%u, %u, %u): %s", b.x, b.y, b.z, text);
    w.failed = true;
    yield(w, true);
    __builtin_unreachable();
}

// --------------------------------------------------------------- fibers

void switch_to_fiber(Worker& w, Fiber& f) {
    w.running = &f;
    current = &f.builtins;
#if CUDA_HOST_ASAN
    __sanitizer_start_switch_fiber(&w.fake_stack, f.stack, STACK_BYTES);
#endif
    cuda_host_switch(&w.scheduler_sp, f.sp);
#if CUDA_HOST_ASAN
    __sanitizer_finish_switch_fiber(w.fake_stack, nullptr, nullptr);
#endif
    w.running = nullptr;
}

// From a fiber back to the scheduler; returns when the scheduler resumes it.
void yield(Worker& w, bool exiting) {
    Fiber& f = *w.running;
#if CUDA_HOST_ASAN
    void* fake = nullptr;
    __sanitizer_start_switch_fiber(exiting ? nullptr : &fake, w.os_stack_bottom, w.os_stack_size);
#endif
    cuda_host_switch(&f.sp, w.scheduler_sp);
#if CUDA_HOST_ASAN
    __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
    (void)exiting;
}

}  // namespace
}  // namespace cuda_host

using namespace cuda_host;

extern "C" [[noreturn]] void cuda_host_fiber_main(Fiber* f) {
    Worker& w = *f->worker;
#if CUDA_HOST_ASAN
    __sanitizer_finish_switch_fiber(nullptr, &w.os_stack_bottom, &w.os_stack_size);
#endif
    w.launch->kernel->invoke(w.launch->kernel->fn, w.launch->args);
    // A lane that returns while others wait for it at a warp operation: they would hang.
    Warp& warp = w.warps[f->warp];
    warp.exited |= 1u << f->lane;
    for (unsigned waiting = warp.waiting; waiting; waiting &= waiting - 1) {
        const Fiber& g = w.fibers[f->warp * 32 + __builtin_ctz(waiting)];
        if (g.call.mask >> f->lane & 1)
            fail(w, "thread %d returned while lane %d waits for it at %s (%s, mask 0x%08x)", f->tid,
                 g.lane, mode_name(g.call.mode), where(g.call.site).c_str(), g.call.mask);
    }
    f->state = EXITED;
    w.live--;
    yield(w, true);
    __builtin_unreachable();
}

namespace cuda_host {
namespace {

// Fiber stacks outlive launches: a launch of 1024 threads would otherwise map and fault in
// 1024 new stacks.
std::mutex stacks_lock;
std::vector<char*> free_stacks;

char* take_stack() {
    {
        std::lock_guard<std::mutex> guard(stacks_lock);
        if (!free_stacks.empty()) {
            char* s = free_stacks.back();
            free_stacks.pop_back();
            return s;
        }
    }
    const long page = sysconf(_SC_PAGESIZE);
    void* p = mmap(nullptr, STACK_BYTES + page, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return nullptr;
    mprotect(p, page, PROT_NONE);  // a stack overflow faults instead of corrupting
    return (char*)p + page;
}

void give_back_stacks(Worker& w) {
    std::lock_guard<std::mutex> guard(stacks_lock);
    for (Fiber& f : w.fibers)
        if (f.stack) free_stacks.push_back(f.stack);
}

bool start_fiber(Worker& w, Fiber& f) {
    if (!f.stack && !(f.stack = take_stack())) {
        report(*w.launch, 3, "out of memory for thread stacks");
        return false;
    }
#if CUDA_HOST_ASAN
    __asan_unpoison_memory_region(f.stack, STACK_BYTES);  // an abandoned fiber's redzones
#endif
    // Stacks are a page multiple apart, so their tops would all fall in the same cache sets;
    // staggering them by the thread id stops the switches evicting each other's frames.
    auto* top = reinterpret_cast<uint64_t*>(f.stack + STACK_BYTES - 64 * (f.tid % 64));
    *--top = 0;                                                      // alignment
    *--top = reinterpret_cast<uint64_t>(&cuda_host_fiber_start);    // ret
    *--top = 0;                                                      // rbp
    *--top = reinterpret_cast<uint64_t>(&f);                         // rbx
    for (int i = 0; i < 4; i++) *--top = 0;                          // r12-r15
    f.sp = top;
    f.worker = &w;
    f.state = RUNNABLE;
    return true;
}

// --------------------------------------------------------------- warp operations

// PTX shfl.sync's source lane for `lane`: out-of-segment sources read the lane itself.
int source_lane(ShuffleMode mode, int lane, int arg, int width) {
    const int segmask = 32 - width;                    // high lane bits: the segment
    const int clamp = mode == SHFL_UP ? 0 : 31;
    const int max_lane = (lane & segmask) | (clamp & ~segmask);
    const int b = arg & 31;
    int j = lane;
    bool ok = false;
    switch (mode) {
        case SHFL_UP: j = lane - b; ok = j >= max_lane; break;
        case SHFL_DOWN: j = lane + b; ok = j <= max_lane; break;
        case SHFL_XOR: j = lane ^ b; ok = j <= max_lane; break;
        case SHFL_IDX: j = (lane & segmask) | (b & ~segmask); ok = j <= max_lane; break;
        case SYNCWARP: break;
    }
    return ok ? j : lane;
}

// The last lane of `mask` has arrived: check that all lanes agree, then hand out results.
void complete_warp_op(Worker& w, int warp, unsigned mask) {
    Fiber* lanes = &w.fibers[warp * 32];
    const WarpCall& first = lanes[__builtin_ctz(mask)].call;
    for (unsigned m = mask; m; m &= m - 1) {
        const WarpCall& c = lanes[__builtin_ctz(m)].call;
        if (c.mode != first.mode || c.mask != first.mask || c.width != first.width || !(c.site == first.site))
            fail(w, "warp %d: lanes of mask 0x%08x meet at different warp operations:%s", warp, mask,
                 waiting_summary(w).c_str());
    }
    unsigned long long results[32];
    for (unsigned m = mask; m; m &= m - 1) {
        const int lane = __builtin_ctz(m);
        const int src = source_lane(first.mode, lane, lanes[lane].call.arg, first.width);
        if (src != lane && !(mask >> src & 1))
            fail(w, "warp %d lane %d: %s (%s) reads lane %d, which is not in the mask 0x%08x", warp,
                 lane, mode_name(first.mode), where(first.site).c_str(), src, mask);
        results[lane] = lanes[src].call.value;
    }
    for (unsigned m = mask; m; m &= m - 1) {
        const int lane = __builtin_ctz(m);
        lanes[lane].call.value = results[lane];
        lanes[lane].state = RUNNABLE;
    }
    w.warps[warp].waiting &= ~mask;
}

}  // namespace

unsigned long long warp_op(ShuffleMode mode, unsigned mask, unsigned long long bits, int arg,
                           int width, const char* file, int line) {
    Worker& w = *this_worker;
    Fiber& f = *w.running;
    Warp& warp = w.warps[f.warp];
    f.call = {mode, mask, bits, arg, width, {file, line}};
    const bool bad_width = width < 1 || width > 32 || (width & (width - 1));
    if (!(mask >> f.lane & 1) || bad_width || (mask & ~warp.present) || (mask & warp.exited)) {
        const char* name = mode_name(mode);
        const std::string at = where(f.call.site);
        if (!(mask >> f.lane & 1))
            fail(w, "thread %d calls %s (%s) with mask 0x%08x, which leaves out its own lane %d",
                 f.tid, name, at.c_str(), mask, f.lane);
        if (bad_width)
            fail(w, "thread %d calls %s (%s) with width %d: not a power of two <= 32", f.tid, name,
                 at.c_str(), width);
        if (mask & ~warp.present)
            fail(w, "thread %d calls %s (%s) with mask 0x%08x, naming lanes that do not exist "
                 "(warp has 0x%08x)", f.tid, name, at.c_str(), mask, warp.present);
        fail(w, "thread %d calls %s (%s) with mask 0x%08x, but lanes 0x%08x have returned", f.tid,
             name, at.c_str(), mask, mask & warp.exited);
    }
    f.state = AT_WARP;
    warp.waiting |= 1u << f.lane;
    if ((warp.waiting & mask) == mask) complete_warp_op(w, f.warp, mask);
    else yield(w);
    return f.call.value;
}

void syncthreads(const char* file, int line) {
    Worker& w = *this_worker;
    Fiber& f = *w.running;
    f.state = AT_BARRIER;
    f.site = {file, line};
    w.at_barrier++;
    yield(w);
}

void kernel_error(const char* what, const char* file, int line) {
    Worker& w = *this_worker;
    fail(w, "thread %d: %s (%s)", w.running->tid, what, where({file, line}).c_str());
}

namespace {

// --------------------------------------------------------------- the scheduler

uint64_t splitmix64(uint64_t& s) {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

void make_order(Worker& w, uint64_t& rng) {
    const int n = (int)w.order.size();
    for (int i = 0; i < n; i++) w.order[i] = w.launch->order == 1 ? n - 1 - i : i;
    if (w.launch->order == 2)
        for (int i = n - 1; i > 0; i--) std::swap(w.order[i], w.order[splitmix64(rng) % (i + 1)]);
}

// Every live thread is at a barrier: release them, unless some returned or wait elsewhere.
bool release_barrier(Worker& w) {
    const Site site = [&] {
        for (const Fiber& f : w.fibers)
            if (f.state == AT_BARRIER) return f.site;
        return Site{};
    }();
    bool same = true, any_exited = false;
    for (const Fiber& f : w.fibers) {
        if (f.state == AT_BARRIER && !(f.site == site)) same = false;
        if (f.state == EXITED) any_exited = true;
    }
    if (!same || any_exited) {
        const uint3 b = w.block_idx;
        report(*w.launch, 1, "block (%u, %u, %u): divergent __syncthreads: %s%s", b.x, b.y, b.z,
               same ? "some threads returned while the others wait at a barrier"
                    : "threads wait at different barriers",
               waiting_summary(w).c_str());
        return false;
    }
    for (Fiber& f : w.fibers)
        if (f.state == AT_BARRIER) f.state = RUNNABLE;
    w.at_barrier = 0;
    return true;
}

bool check_dynamic_shared(Worker& w);

bool run_block(Worker& w, uint3 block_idx) {
    Launch& l = *w.launch;
    const int nx = l.block.x, ny = l.block.y;
    const int n = nx * ny * l.block.z;
    w.block_idx = block_idx;
    std::memset(w.tls, l.poison, w.tls_bytes);
    for (int i = 0; i < (int)w.warps.size(); i++)
        w.warps[i] = {i * 32 + 32 <= n ? 0xffffffffu : (1u << (n - i * 32)) - 1, 0, 0};
    for (int t = 0; t < n; t++) {
        Fiber& f = w.fibers[t];
        f.builtins = {{(unsigned)(t % nx), (unsigned)(t / nx % ny), (unsigned)(t / (nx * ny))},
                      block_idx, l.block, l.grid};
        f.tid = t;
        f.warp = t / 32;
        f.lane = t % 32;
        if (!start_fiber(w, f)) return false;
    }
    w.live = n;
    w.at_barrier = 0;
    uint64_t rng = l.seed ^ (((uint64_t)block_idx.z << 42) | ((uint64_t)block_idx.y << 21) | block_idx.x);
    while (w.live > 0) {
        make_order(w, rng);
        bool ran = false;
        for (int t : w.order) {
            Fiber& f = w.fibers[t];
            if (f.state != RUNNABLE) continue;
            ran = true;
            switch_to_fiber(w, f);
            if (w.failed || l.failed) return false;
        }
        if (w.live == 0) break;
        if (w.at_barrier == w.live) {
            if (!release_barrier(w)) return false;
        } else if (!ran) {
            report(l, 1, "block (%u, %u, %u): deadlock: no thread can run%s", block_idx.x,
                   block_idx.y, block_idx.z, waiting_summary(w).c_str());
            return false;
        }
    }
    return check_dynamic_shared(w);
}

// Bytes of `extern __shared__` arrays past what the launch asked for must still hold the
// poison: on a GPU a write there is out of bounds.
bool check_dynamic_shared(Worker& w) {
    const Launch& l = *w.launch;
    for (int i = 0; i < l.module->num_dynamic; i++) {
        const auto* bytes = static_cast<const unsigned char*>(l.module->dynamic_shared(i));
        for (size_t b = l.shared_bytes; b < CUDA_HOST_DYNAMIC_SHARED; b++)
            if (bytes[b] != l.poison) {
                report(*w.launch, 1, "block (%u, %u, %u): wrote dynamic shared memory at byte %zu, "
                       "past the %llu bytes the launch requested", w.block_idx.x, w.block_idx.y,
                       w.block_idx.z, b, l.shared_bytes);
                return false;
            }
    }
    return true;
}

// Where this thread's copy of the kernel module's thread_local (= __shared__) data lies.
void find_tls(Worker& w) {
    void* anchor = w.launch->module->tls_anchor();
    struct Query { void* anchor; char* tls; size_t bytes; } q{anchor, nullptr, 0};
    dl_iterate_phdr([](dl_phdr_info* info, size_t, void* data) {
        auto* q = static_cast<Query*>(data);
        if (!info->dlpi_tls_data) return 0;
        for (int i = 0; i < info->dlpi_phnum; i++) {
            const ElfW(Phdr)& ph = info->dlpi_phdr[i];
            if (ph.p_type != PT_TLS) continue;
            char* start = static_cast<char*>(info->dlpi_tls_data);
            if (start <= q->anchor && q->anchor < start + ph.p_memsz) {
                q->tls = start;
                q->bytes = ph.p_memsz;
                return 1;
            }
        }
        return 0;
    }, &q);
    w.tls = q.tls;
    w.tls_bytes = q.bytes;
}

struct sigaction old_actions[32];
const int FAULTS[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL};

void on_fault(int sig, siginfo_t* info, void* context) {
    Worker* w = this_worker;
    if (!w || !w->running) {  // not a kernel's fault: whatever handled it before
        sigaction(sig, &old_actions[sig], nullptr);
        return;  // the instruction faults again, now under the old handler
    }
    const auto* uc = static_cast<const ucontext_t*>(context);
    Launch& l = *w->launch;
    {
        std::lock_guard<std::mutex> guard(l.error_lock);
        if (!l.failed.exchange(true)) {
            l.status = 2;
            l.fault_addr = reinterpret_cast<unsigned long long>(info->si_addr);
            l.fault_write = sig == SIGSEGV && (uc->uc_mcontext.gregs[REG_ERR] & 2) ? 1 : 0;
            const uint3 b = w->block_idx;
            snprintf(l.message, sizeof l.message, "%s in block (%u, %u, %u) thread %d",
                     sig == SIGSEGV ? "invalid memory access" : sig == SIGBUS ? "bus error"
                     : sig == SIGFPE ? "arithmetic fault (integer division by zero?)"
                                     : "illegal instruction (a sanitizer trap?)",
                     b.x, b.y, b.z, w->running ? w->running->tid : -1);
        }
    }
    w->failed = true;
    siglongjmp(w->fault_jump, 1);
}

void work(Launch* l, int id) {
    // The module's -ftz=true as the GPU applies it to float32 arithmetic: subnormal results
    // flushed to zero (FTZ) and subnormal inputs read as zero (DAZ). MXCSR is per OS thread,
    // and this thread exists for this launch only.
    if (l->ftz) _mm_setcsr(_mm_getcsr() | 0x8040);
    Worker w;
    w.launch = l;
    this_worker = &w;
    const int n = l->block.x * l->block.y * l->block.z;
    w.fibers.resize(n);
    w.warps.resize((n + 31) / 32);
    w.order.resize(n);
    find_tls(w);
    std::vector<char> alt(SIGSTKSZ + 64 * 1024);  // faults are handled off the fiber's stack
    stack_t ss{alt.data(), 0, alt.size()};
    sigaltstack(&ss, nullptr);
    const long long blocks = (long long)l->grid.x * l->grid.y * l->grid.z;
    if (sigsetjmp(w.fault_jump, 1) == 0) {
        for (long long b; !l->failed && (b = l->next_block++) < blocks;) {
            const uint3 idx{(unsigned)(b % l->grid.x), (unsigned)(b / l->grid.x % l->grid.y),
                            (unsigned)(b / ((long long)l->grid.x * l->grid.y))};
            if (!run_block(w, idx)) break;
        }
    }
    stack_t off{nullptr, SS_DISABLE, 0};
    sigaltstack(&off, nullptr);
    give_back_stacks(w);
    this_worker = nullptr;
    (void)id;
}

}  // namespace
}  // namespace cuda_host

struct LaunchConfig {
    unsigned grid[3], block[3];
    unsigned long long shared_bytes;
    int order;  // 0 in order, 1 reversed, 2 shuffled with `seed`
    unsigned long long seed;
    int poison;
    int workers;
    int ftz;
};

struct LaunchResult {
    int status;  // 0 ok, 1 kernel error, 2 memory fault (fault_addr), 3 bad launch
    unsigned long long fault_addr;
    int fault_write;
    char message[2048];
};

// Runs one kernel launch to completion (or to its first error) on `workers` OS threads.
extern "C" __attribute__((visibility("default"))) void cuda_host_launch(
        const Module* module, const Kernel* kernel, const LaunchConfig* cfg, void* const* args,
        LaunchResult* result) {
    Launch l;
    l.module = module;
    l.kernel = kernel;
    l.grid = dim3(cfg->grid[0], cfg->grid[1], cfg->grid[2]);
    l.block = dim3(cfg->block[0], cfg->block[1], cfg->block[2]);
    l.shared_bytes = cfg->shared_bytes;
    l.order = cfg->order;
    l.seed = cfg->seed;
    l.poison = (unsigned char)cfg->poison;
    l.ftz = cfg->ftz != 0;
    l.args = args;
    const unsigned long long threads = (unsigned long long)l.block.x * l.block.y * l.block.z;
    if (!l.grid.x || !l.grid.y || !l.grid.z || l.grid.y > 65535 || l.grid.z > 65535 || l.grid.x > 0x7fffffffu)
        report(l, 3, "invalid grid (%u, %u, %u)", l.grid.x, l.grid.y, l.grid.z);
    else if (!threads || threads > 1024 || l.block.z > 64)
        report(l, 3, "invalid block (%u, %u, %u): at most 1024 threads, z <= 64", l.block.x,
               l.block.y, l.block.z);
    else if (kernel->max_threads && threads > (unsigned long long)kernel->max_threads)
        report(l, 3, "block of %llu threads exceeds %s's __launch_bounds__(%d)", threads,
               kernel->name, kernel->max_threads);
    else if (l.shared_bytes > CUDA_HOST_DYNAMIC_SHARED)
        report(l, 3, "%llu bytes of dynamic shared memory requested, the limit is %d", l.shared_bytes,
               CUDA_HOST_DYNAMIC_SHARED);
    if (!l.failed) {
        struct sigaction sa {};
        sa.sa_sigaction = on_fault;
        sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
        if (!CUDA_HOST_ASAN)
            for (int sig : FAULTS) sigaction(sig, &sa, &old_actions[sig]);
        std::vector<std::thread> pool;
        const long long blocks = (long long)l.grid.x * l.grid.y * l.grid.z;
        const int workers = (int)std::max(1LL, std::min<long long>(cfg->workers, blocks));
        for (int i = 0; i < workers; i++) pool.emplace_back(work, &l, i);
        for (auto& t : pool) t.join();
        if (!CUDA_HOST_ASAN)
            for (int sig : FAULTS) sigaction(sig, &old_actions[sig], nullptr);
    }
    result->status = l.status;
    result->fault_addr = l.fault_addr;
    result->fault_write = l.fault_write;
    std::memcpy(result->message, l.message, sizeof result->message);
}
