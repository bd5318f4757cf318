// The emulated device's launcher: runs a kernel's grid on the host, block after block, with
// every CUDA thread of a block as a fiber (see kernels/emu.h for the execution model).
//
// Compiled last into the one translation unit the host builds (after kernels/emu.h,
// kernels/common.cuh, every kernels/*.cu and the generated entry table `EMU_ENTRIES`).
// Fibers switch with a few instructions of assembly on x86-64 (announced to
// AddressSanitizer when it is on) and with ucontext elsewhere.

#include <mutex>
#include <string>
#include <utility>
#include <vector>
#include <cstdio>
#include <cstdlib>
#include <sys/mman.h>
#include <unistd.h>

#if !defined(__x86_64__)
#define EMU_UCONTEXT 1
#include <ucontext.h>
#endif

#ifdef __SANITIZE_ADDRESS__
extern "C" void __sanitizer_start_switch_fiber(void** fake_stack_save, const void* bottom, size_t size);
extern "C" void __sanitizer_finish_switch_fiber(void* fake_stack_save, const void** bottom_old, size_t* size_old);
#define ASAN_START(save, bottom, size) __sanitizer_start_switch_fiber((save), (bottom), (size))
#define ASAN_FINISH(save, bottom, size) __sanitizer_finish_switch_fiber((save), (bottom), (size))
#else
#define ASAN_START(save, bottom, size) ((void)0)
#define ASAN_FINISH(save, bottom, size) ((void)0)
#endif

namespace {

// ---------------------------------------------------------------- entry table

template <typename F>
struct EmuFn;
template <typename... P>
struct EmuFn<void (*)(P...)> {
    template <void (*F)(P...), size_t... I>
    static void call_impl(void** a, std::index_sequence<I...>) {
        F(*reinterpret_cast<P*>(a[I])...);
    }
    template <void (*F)(P...)>
    static void call(void** a) {
        call_impl<F>(a, std::index_sequence_for<P...>{});
    }
    static constexpr int arity = (int)sizeof...(P);
};

struct Entry {
    const char* name;
    void (*call)(void**);
    int arity;
};

#define EMU_ENTRY(name) {#name, &EmuFn<decltype(&name)>::call<&name>, EmuFn<decltype(&name)>::arity},
const Entry ENTRIES[] = {EMU_ENTRIES};
#undef EMU_ENTRY

const Entry* find_entry(const char* name) {
    for (const Entry& e : ENTRIES)
        if (std::strcmp(e.name, name) == 0) return &e;
    return nullptr;
}

// ---------------------------------------------------------------- fibers

const size_t STACK_BYTES = 128 * 1024;
const unsigned MAX_THREADS = 1024;
const size_t MAX_DYNAMIC_SMEM = 227 * 1024;  // sm_90's largest opt-in block allocation

enum State { READY, AT_BLOCK, AT_WARP, DONE };

struct Fiber {
    EmuThread t;
    State state;
    int op, site;
    char* stack;  // STACK_BYTES, a guard page below
    void* fake_stack;  // AddressSanitizer's bookkeeping while suspended
#ifdef EMU_UCONTEXT
    ucontext_t ctx;
#else
    void* sp;
#endif
};

struct Warp {
    uint64_t slots[2][32];
    uint32_t mma[2][32 * 6];
};

struct Run {
    const Entry* entry;
    void** params;
    Fiber* fibers;
    unsigned n;
    Warp* warps;
#ifdef EMU_UCONTEXT
    ucontext_t sched;
#else
    void* sched_sp;
#endif
    void* sched_fake_stack;
    const void* sched_bottom;  // the scheduler's stack, as AddressSanitizer reports it
    size_t sched_size;
};

Run* run_now;
std::mutex launch_lock;
std::vector<Fiber*> pool;  // fibers with their stacks, reused by every launch
std::vector<Warp> warps(MAX_THREADS / 32);
alignas(16) unsigned char dynamic_smem[MAX_DYNAMIC_SMEM];

char* new_stack() {
    long page = sysconf(_SC_PAGESIZE);
    void* p = mmap(nullptr, STACK_BYTES + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return nullptr;
    mprotect(p, page, PROT_NONE);  // overflow faults instead of corrupting a neighbour
    return (char*)p + page;
}

#ifndef EMU_UCONTEXT
extern "C" void emu_switch(void** save, void* load);
extern "C" void emu_trampoline();
asm(R"(
.text
.p2align 4
.type emu_switch,@function
emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
.size emu_switch, .-emu_switch
.p2align 4
.type emu_trampoline,@function
emu_trampoline:
    movq %r12, %rdi
    call emu_fiber_main
    ud2
.size emu_trampoline, .-emu_trampoline
)");
#endif

}  // namespace

extern "C" __attribute__((visibility("hidden"), used)) void emu_fiber_main(void* fiber) {
    Fiber* f = (Fiber*)fiber;
    ASAN_FINISH(nullptr, &run_now->sched_bottom, &run_now->sched_size);
    run_now->entry->call(run_now->params);
    f->state = DONE;
    // A finished fiber's stack is abandoned (null: no fake stack to keep).
    ASAN_START(nullptr, run_now->sched_bottom, run_now->sched_size);
#ifdef EMU_UCONTEXT
    // Returning resumes uc_link (the scheduler).
#else
    emu_switch(&f->sp, run_now->sched_sp);
    __builtin_unreachable();
#endif
}

namespace {

#ifdef EMU_UCONTEXT
void fiber_entry_uc(unsigned lo, unsigned hi) {
    emu_fiber_main((Fiber*)(((uintptr_t)hi << 32) | (uintptr_t)lo));
}
#endif

void start_fiber(Run& r, Fiber* f) {
#ifdef EMU_UCONTEXT
    getcontext(&f->ctx);
    f->ctx.uc_stack.ss_sp = f->stack;
    f->ctx.uc_stack.ss_size = STACK_BYTES;
    f->ctx.uc_link = &r.sched;
    uintptr_t p = (uintptr_t)f;
    makecontext(&f->ctx, (void (*)())fiber_entry_uc, 2, (unsigned)(p & 0xffffffffu), (unsigned)(p >> 32));
#else
    (void)r;
    // Stack as emu_switch leaves it: control words, r15..rbp, the return address.
    uint64_t* top = (uint64_t*)(((uintptr_t)(f->stack + STACK_BYTES)) & ~(uintptr_t)15);
    uint64_t* sp = top - 8;
    uint32_t csr[2];
    asm volatile("stmxcsr %0" : "=m"(csr[0]));
    asm volatile("fnstcw %0" : "=m"(*(uint16_t*)&csr[1]));
    std::memcpy(sp, csr, 8);
    sp[1] = 0;              // r15
    sp[2] = 0;              // r14
    sp[3] = 0;              // r13
    sp[4] = (uint64_t)f;    // r12: the fiber, for the trampoline
    sp[5] = 0;              // rbx
    sp[6] = 0;              // rbp
    sp[7] = (uint64_t)&emu_trampoline;
    f->sp = sp;
#endif
}

void resume(Run& r, Fiber* f) {
    emu_cur = &f->t;
    ASAN_START(&r.sched_fake_stack, f->stack, STACK_BYTES);
#ifdef EMU_UCONTEXT
    swapcontext(&r.sched, &f->ctx);
#else
    emu_switch(&r.sched_sp, f->sp);
#endif
    ASAN_FINISH(r.sched_fake_stack, nullptr, nullptr);
}

Fiber* current_fiber() {
    return (Fiber*)((char*)emu_cur - offsetof(Fiber, t));
}

void yield_to_scheduler() {
    Fiber* f = current_fiber();
    ASAN_START(&f->fake_stack, run_now->sched_bottom, run_now->sched_size);
#ifdef EMU_UCONTEXT
    swapcontext(&f->ctx, &run_now->sched);
#else
    emu_switch(&f->sp, run_now->sched_sp);
#endif
    ASAN_FINISH(f->fake_stack, &run_now->sched_bottom, &run_now->sched_size);
}

const char* op_name(int op) {
    switch (op) {
        case EMU_SYNCWARP: return "__syncwarp";
        case EMU_SHFL: return "a shuffle";
        case EMU_BALLOT: return "a ballot";
        case EMU_MMA: return "mma";
        default: return "__syncthreads";
    }
}

// Strict mode (NINFER_EMU_STRICT=1): static shared memory poisoned before each block, and
// threads resumed last to first.
bool strict_mode() {
    static const bool on = [] {
        const char* v = std::getenv("NINFER_EMU_STRICT");
        return v && std::strcmp(v, "1") == 0;
    }();
    return on;
}

// Every `__shared__` static of every kernel (kernels/emu.h puts them in this section).
extern "C" char __start_emu_shared[] __attribute__((weak));
extern "C" char __stop_emu_shared[] __attribute__((weak));

void poison_static_shared() {
    if (__start_emu_shared && __stop_emu_shared > __start_emu_shared)
        std::memset(__start_emu_shared, 0xff, (size_t)(__stop_emu_shared - __start_emu_shared));
}

// Runs every fiber of one block to completion. Returns an empty string, or why the block
// cannot complete (a divergent barrier).
std::string run_block(Run& r) {
    for (unsigned i = 0; i < r.n; ++i) start_fiber(r, &r.fibers[i]);
    unsigned done = 0;
    unsigned nwarps = (r.n + 31) / 32;
    const bool reverse = strict_mode();
    for (;;) {
        bool moved = false;
        for (unsigned j = 0; j < r.n; ++j) {
            Fiber* f = &r.fibers[reverse ? r.n - 1 - j : j];
            if (f->state != READY) continue;
            resume(r, f);
            moved = true;
            if (f->state == DONE) ++done;
        }
        if (done == r.n) return std::string();
        // Warp barriers: complete when every lane of the warp waits at the same one.
        for (unsigned w = 0; w < nwarps; ++w) {
            unsigned lo = w * 32, hi = lo + 32 < r.n ? lo + 32 : r.n;
            unsigned waiting = 0, exited = 0;
            for (unsigned i = lo; i < hi; ++i) {
                waiting += r.fibers[i].state == AT_WARP;
                exited += r.fibers[i].state == DONE;
            }
            if (waiting == 0) continue;
            int op = -1, site = -1;
            bool same = true;
            for (unsigned i = lo; i < hi; ++i) {
                const Fiber& f = r.fibers[i];
                if (f.state != AT_WARP) continue;
                if (op < 0) {
                    op = f.op;
                    site = f.site;
                } else if (f.op != op || f.site != site) {
                    same = false;
                }
            }
            if (waiting + exited == hi - lo && (exited > 0 || !same || hi - lo != 32)) {
                char m[200];
                std::snprintf(m, sizeof m,
                              "divergent warp: in block (%u,%u,%u) warp %u, %u lanes wait at %s (line %d), %u lanes "
                              "have exited%s",
                              emu_block_idx.x, emu_block_idx.y, emu_block_idx.z, w, waiting, op_name(op), site,
                              exited, same ? "" : ", and the waiting lanes are at different operations");
                return m;
            }
            if (waiting == hi - lo) {
                for (unsigned i = lo; i < hi; ++i) r.fibers[i].state = READY;
                moved = true;
            }
        }
        if (moved) continue;
        // The block barrier: complete when every thread waits at the same __syncthreads.
        unsigned at_block = 0;
        int site = -1;
        bool same = true;
        for (unsigned i = 0; i < r.n; ++i) {
            const Fiber& f = r.fibers[i];
            if (f.state != AT_BLOCK) continue;
            if (site < 0) site = f.site;
            else if (f.site != site) same = false;
            ++at_block;
        }
        if (at_block == r.n && same) {
            for (unsigned i = 0; i < r.n; ++i) r.fibers[i].state = READY;
            continue;
        }
        char m[240];
        std::snprintf(m, sizeof m,
                      "divergent __syncthreads: in block (%u,%u,%u) of %u threads, %u wait at __syncthreads "
                      "(line %d%s), %u have exited, %u wait at warp operations",
                      emu_block_idx.x, emu_block_idx.y, emu_block_idx.z, r.n, at_block, site,
                      same ? "" : " and others", done, r.n - done - at_block);
        return m;
    }
}

void set_error(char* err, size_t len, const std::string& m) {
    if (len == 0) return;
    std::snprintf(err, len, "%s", m.c_str());
}

}  // namespace

// ---------------------------------------------------------------- synchronization points

static void emu_block_barrier(int site) {
    Fiber* f = current_fiber();
    f->state = AT_BLOCK;
    f->op = 0;
    f->site = site;
    yield_to_scheduler();
}

static void emu_warp_barrier(int op, int site) {
    Fiber* f = current_fiber();
    f->state = AT_WARP;
    f->op = op;
    f->site = site;
    yield_to_scheduler();
}

static uint64_t* emu_warp_slots(int parity) {
    return warps[emu_cur->warp].slots[parity];
}

static uint32_t* emu_warp_mma_slots(int parity) {
    return warps[emu_cur->warp].mma[parity];
}

// ---------------------------------------------------------------- the C interface

// Whether `entry` exists, and its parameter count (-1 when it does not).
extern "C" int ninfer_emu_arity(const char* entry) {
    const Entry* e = find_entry(entry);
    return e ? e->arity : -1;
}

// Runs `entry` over grid (gx, gy, gz) with `block` threads and `smem` bytes of dynamic
// shared memory; `params[i]` points at argument i, as cuLaunchKernel takes them. Returns 0,
// or non-zero with a one-line reason in `err`.
extern "C" int ninfer_emu_launch(const char* entry, unsigned gx, unsigned gy, unsigned gz, unsigned block,
                                 size_t smem, void** params, char* err, size_t errlen) {
    const Entry* e = find_entry(entry);
    if (!e) {
        set_error(err, errlen, std::string("no kernel `") + entry + "` in the emulated device");
        return 1;
    }
    if (block == 0 || block > MAX_THREADS) {
        set_error(err, errlen, "block of " + std::to_string(block) + " threads (1..=1024)");
        return 1;
    }
    if (smem > MAX_DYNAMIC_SMEM) {
        set_error(err, errlen, std::to_string(smem) + " bytes of dynamic shared memory (at most 227 KiB)");
        return 1;
    }
    std::lock_guard<std::mutex> guard(launch_lock);
    while (pool.size() < block) {
        Fiber* f = new Fiber();
        f->stack = new_stack();
        if (!f->stack) {
            delete f;
            set_error(err, errlen, "cannot map fiber stacks");
            return 1;
        }
        pool.push_back(f);
    }
    std::vector<Fiber> fibers(block);
    for (unsigned i = 0; i < block; ++i) fibers[i].stack = pool[i]->stack;
    Run r = {};
    r.entry = e;
    r.params = params;
    r.fibers = fibers.data();
    r.n = block;
    r.warps = warps.data();
    Run* saved = run_now;
    run_now = &r;
    emu_grid_dim = {gx, gy, gz};
    emu_block_dim = {block, 1, 1};
    emu_dynamic_smem = dynamic_smem;
    std::string why;
    for (unsigned z = 0; z < gz && why.empty(); ++z)
        for (unsigned y = 0; y < gy && why.empty(); ++y)
            for (unsigned x = 0; x < gx && why.empty(); ++x) {
                emu_block_idx = {x, y, z};
                // Shared memory starts as garbage on a GPU; here as NaN-like bytes.
                if (smem) std::memset(dynamic_smem, 0xff, smem);
                if (strict_mode()) poison_static_shared();
                for (unsigned i = 0; i < block; ++i) {
                    Fiber& f = fibers[i];
                    f.t.tid = {i, 0, 0};
                    f.t.linear = i;
                    f.t.lane = i & 31;
                    f.t.warp = i >> 5;
                    f.t.xchg = 0;
                    f.state = READY;
                    f.op = f.site = 0;
                }
                why = run_block(r);
            }
    run_now = saved;
    if (!why.empty()) {
        set_error(err, errlen, std::string("`") + entry + "`: " + why);
        return 1;
    }
    return 0;
}
