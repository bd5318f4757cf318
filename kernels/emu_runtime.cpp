// The emulated device's launcher: runs a kernel's grid on the host, block after block, with
// every CUDA thread of a block as a fiber (see kernels/emu.h for the execution model).
//
// Compiled last into the one translation unit the host builds (after kernels/emu.h,
// kernels/common.cuh, every kernels/*.cu and the generated entry table `EMU_ENTRIES`).
// Fibers switch with a few instructions of assembly on x86-64 (announced to
// AddressSanitizer when it is on) and with ucontext elsewhere.
//
// In the race checker's build (NINFER_EMU_RACECHECK=1: compiled with -fsanitize=thread but
// linked without ThreadSanitizer's runtime) this file also defines the `__tsan_*` functions
// the instrumented kernels call on every load and store, and keeps a shadow record of each
// word of shared memory (see "the race checker" below). Every function of this file is
// EMU_UNCHECKED: never instrumented itself.

#include <dlfcn.h>
#include <mutex>
#include <string>
#include <utility>
#include <vector>
#include <cstdio>
#include <cstdlib>
#include <sys/mman.h>
#include <unistd.h>
#if defined(__SANITIZE_THREAD__)
#define EMU_RACECHECK 1
#include <dlfcn.h>
#include <link.h>
#endif

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
    EMU_UNCHECKED static void call_impl(void** a, std::index_sequence<I...>) {
        F(*reinterpret_cast<P*>(a[I])...);
    }
    template <void (*F)(P...)>
    EMU_UNCHECKED static void call(void** a) {
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

EMU_UNCHECKED const Entry* find_entry(const char* name) {
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
    uint32_t mma[2][32 * EMU_MMA_SLOT];
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

EMU_UNCHECKED char* new_stack() {
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

extern "C" EMU_UNCHECKED __attribute__((visibility("hidden"), used)) void emu_fiber_main(void* fiber) {
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
EMU_UNCHECKED void fiber_entry_uc(unsigned lo, unsigned hi) {
    emu_fiber_main((Fiber*)(((uintptr_t)hi << 32) | (uintptr_t)lo));
}
#endif

EMU_UNCHECKED void start_fiber(Run& r, Fiber* f) {
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

EMU_UNCHECKED void resume(Run& r, Fiber* f) {
    emu_cur = &f->t;
    ASAN_START(&r.sched_fake_stack, f->stack, STACK_BYTES);
#ifdef EMU_UCONTEXT
    swapcontext(&r.sched, &f->ctx);
#else
    emu_switch(&r.sched_sp, f->sp);
#endif
    ASAN_FINISH(r.sched_fake_stack, nullptr, nullptr);
}

EMU_UNCHECKED Fiber* current_fiber() {
    return (Fiber*)((char*)emu_cur - offsetof(Fiber, t));
}

EMU_UNCHECKED void yield_to_scheduler() {
    Fiber* f = current_fiber();
    ASAN_START(&f->fake_stack, run_now->sched_bottom, run_now->sched_size);
#ifdef EMU_UCONTEXT
    swapcontext(&f->ctx, &run_now->sched);
#else
    emu_switch(&f->sp, run_now->sched_sp);
#endif
    ASAN_FINISH(f->fake_stack, &run_now->sched_bottom, &run_now->sched_size);
}

EMU_UNCHECKED const char* op_name(int op) {
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
EMU_UNCHECKED bool strict_mode() {
    static const bool on = [] {
        const char* v = std::getenv("NINFER_EMU_STRICT");
        return v && std::strcmp(v, "1") == 0;
    }();
    return on;
}

// Every `__shared__` static of every kernel (kernels/emu.h puts them in this section).
extern "C" char __start_emu_shared[] __attribute__((weak));
extern "C" char __stop_emu_shared[] __attribute__((weak));

// The `__shared__` statics of function templates, which GCC (before 14) leaves out of the
// section: (offset in this library, bytes), given by the host from the library's symbol
// table (`ninfer_emu_static_shared`).
std::vector<std::pair<uint64_t, uint64_t>> template_shared;

EMU_UNCHECKED void poison_static_shared() {
    if (__start_emu_shared && __stop_emu_shared > __start_emu_shared)
        std::memset(__start_emu_shared, 0xff, (size_t)(__stop_emu_shared - __start_emu_shared));
    static char* base = [] {
        Dl_info info;
        return dladdr((void*)&poison_static_shared, &info) ? (char*)info.dli_fbase : nullptr;
    }();
    if (base)
        for (const auto& r : template_shared) std::memset(base + r.first, 0xff, (size_t)r.second);
}

// ---------------------------------------------------------------- the race checker

// Happens-before within a block, by epochs: the block's epoch advances each time a
// __syncthreads completes, and a warp's sync count each time its __syncwarp completes.
// Access a (thread ta, epoch Ea, its warp's count Wa) is ordered before access b (thread
// tb, Eb, Wb) when ta == tb, or Ea < Eb, or ta and tb share a warp and Wa < Wb. Shuffles,
// ballots and mma do not advance anything: CUDA gives them no memory ordering. The epoch
// also advances at the start of every block (blocks run one after another here and share
// nothing on a GPU), so the records of an earlier block or launch are simply older: no
// reset is needed.
#ifdef EMU_RACECHECK

const uint16_t RC_NONE = 0xffff;  // no thread
const uint16_t RC_MANY = 0xfffe;  // several threads
const int16_t RC_WARPS = -1;      // readers in more than one warp

// What is known about one 4-byte word of shared memory in the current epoch: its last
// write, and the reads since that write.
struct WordShadow {
    uint32_t w_epoch;  // the last write's epoch (0: never written)
    uint32_t w_wsync;  // the writer's warp sync count then
    uint32_t r_epoch;  // the epoch of the reads recorded (0: none)
    uint32_t r_wsync;  // the latest warp sync count among them (readers in one warp)
    uint16_t w_tid;
    uint16_t r_top;    // the reader at r_wsync, or RC_MANY
    uint16_t r_last;   // for the report: the latest reader, and the latest other one
    uint16_t r_prev;
    int16_t r_warp;    // the readers' warp, or RC_WARPS
    uint8_t w_mask;    // the bytes of the word the last writer wrote (bit i: byte i)
    uint8_t r_mask;    // the bytes read
    uint32_t w_pc, r_last_pc, r_prev_pc;  // call sites, offsets in this library
};

// One hazard: access a (earlier here) and access b, by different threads, unordered.
struct Hazard {
    const char* kind;  // RAW, WAR or WAW
    unsigned a_tid, b_tid;
    uint32_t a_pc, b_pc;   // call sites, offsets in this library
    bool is_static;        // a __shared__ variable (else dynamic shared memory)
    uintptr_t where;       // offset in dynamic shared memory, or of the variable in this library
};

const unsigned RC_MAX_REPORTS = 16;

// Static shared memory: GCC (before 14) ignores the section attribute of a static local
// in a function template, so the `__shared__` arrays of templated kernels are not all in
// the emu_shared section. The checker watches this library's whole writable data
// instead: kernel code writes nothing else there (the runtime's own state is never
// instrumented), and reads of the rest (emu_cur, blockIdx...) race with nothing.
WordShadow* rc_dynamic;  // one per word of dynamic shared memory
WordShadow* rc_static;   // one per word of the library's writable data
uintptr_t rc_static_lo, rc_static_bytes;
uint32_t rc_epoch = 1;
uint32_t rc_wsync[MAX_THREADS / 32];
bool rc_on;  // a block is running
uintptr_t rc_base;  // where this library is loaded
Hazard rc_found[RC_MAX_REPORTS];
unsigned rc_distinct;
unsigned long rc_more;  // racing accesses past the reports

// The span of this library's writable segments.
EMU_UNCHECKED int rc_find_data(dl_phdr_info* info, size_t, void*) {
    if (info->dlpi_addr != rc_base) return 0;
    uintptr_t lo = UINTPTR_MAX, hi = 0;
    for (int i = 0; i < info->dlpi_phnum; ++i) {
        const ElfW(Phdr)& ph = info->dlpi_phdr[i];
        if (ph.p_type != PT_LOAD || !(ph.p_flags & PF_W)) continue;
        uintptr_t a = info->dlpi_addr + ph.p_vaddr;
        if (a < lo) lo = a;
        if (a + ph.p_memsz > hi) hi = a + ph.p_memsz;
    }
    if (hi > lo) {
        rc_static_lo = lo & ~(uintptr_t)3;
        rc_static_bytes = hi - rc_static_lo;
    }
    return 1;
}

EMU_UNCHECKED void rc_setup() {
    if (rc_dynamic) return;
    Dl_info info;
    if (dladdr((void*)&rc_setup, &info) && info.dli_fbase) rc_base = (uintptr_t)info.dli_fbase;
    dl_iterate_phdr(rc_find_data, nullptr);
    // Zero pages from the system: only the words touched cost memory.
    rc_dynamic = (WordShadow*)std::calloc(MAX_DYNAMIC_SMEM / 4, sizeof(WordShadow));
    rc_static = (WordShadow*)std::calloc(rc_static_bytes / 4 + 1, sizeof(WordShadow));
    if (!rc_dynamic || !rc_static) {
        std::fprintf(stderr, "the emulated device's race checker: out of memory\n");
        std::abort();
    }
}

EMU_UNCHECKED void rc_new_epoch() {
    if (++rc_epoch == 0) {  // wrapped: forget everything (epoch 0 means "never")
        std::memset(rc_dynamic, 0, MAX_DYNAMIC_SMEM / 4 * sizeof(WordShadow));
        std::memset(rc_static, 0, (rc_static_bytes / 4 + 1) * sizeof(WordShadow));
        rc_epoch = 1;
    }
}

EMU_UNCHECKED void rc_block_start() {
    rc_setup();
    rc_new_epoch();
    std::memset(rc_wsync, 0, sizeof rc_wsync);
    rc_distinct = 0;
    rc_more = 0;
}

EMU_UNCHECKED void rc_hazard(const char* kind, unsigned a_tid, uint32_t a_pc, unsigned b_tid, uint32_t b_pc,
                             bool is_static, uintptr_t where) {
    for (unsigned i = 0; i < rc_distinct; ++i) {
        const Hazard& h = rc_found[i];
        if (h.kind == kind && h.a_pc == a_pc && h.b_pc == b_pc) return;
    }
    if (rc_distinct == RC_MAX_REPORTS) {
        ++rc_more;  // racing accesses past the reports (repeats included)
        return;
    }
    rc_found[rc_distinct++] = {kind, a_tid, b_tid, a_pc, b_pc, is_static, where};
}

// One access of thread `t` to the bytes `mask` of the word `s`.
EMU_UNCHECKED inline void rc_word(WordShadow& s, uint8_t mask, bool write, uint32_t pc, bool is_static,
                                  uintptr_t where) {
    const unsigned t = emu_cur->linear, warp = emu_cur->warp;
    const uint32_t e = rc_epoch, w = rc_wsync[warp];
    if (s.w_epoch == e && s.w_tid != t && (s.w_mask & mask) && !((s.w_tid >> 5) == warp && s.w_wsync < w))
        rc_hazard(write ? "WAW" : "RAW", s.w_tid, s.w_pc, t, pc, is_static, where);
    if (write) {
        if (s.r_epoch == e && (s.r_mask & mask)) {
            // Reads by another warp are unordered; in this warp, those since its last
            // __syncwarp, unless they are all this thread's.
            bool unordered = s.r_warp != (int16_t)warp || (s.r_wsync == w && s.r_top != t);
            if (unordered) {
                bool last = s.r_last != t;
                rc_hazard("WAR", last ? s.r_last : s.r_prev, last ? s.r_last_pc : s.r_prev_pc, t, pc, is_static,
                          where);
            }
        }
        s.w_mask = s.w_epoch == e && s.w_tid == t ? (uint8_t)(s.w_mask | mask) : mask;
        s.w_epoch = e;
        s.w_tid = (uint16_t)t;
        s.w_wsync = w;
        s.w_pc = pc;
        s.r_epoch = 0;
        return;
    }
    if (s.r_epoch != e) {
        s.r_epoch = e;
        s.r_mask = mask;
        s.r_warp = (int16_t)warp;
        s.r_wsync = w;
        s.r_top = (uint16_t)t;
        s.r_last = (uint16_t)t;
        s.r_last_pc = pc;
        s.r_prev = RC_NONE;
        return;
    }
    s.r_mask |= mask;
    if (s.r_warp != RC_WARPS) {
        if (s.r_warp != (int16_t)warp) s.r_warp = RC_WARPS;
        else if (w > s.r_wsync) {
            s.r_wsync = w;
            s.r_top = (uint16_t)t;
        } else if (s.r_top != t) {
            s.r_top = RC_MANY;
        }
    }
    if (s.r_last != t) {
        s.r_prev = s.r_last;
        s.r_prev_pc = s.r_last_pc;
        s.r_last = (uint16_t)t;
    }
    s.r_last_pc = pc;
}

// An instrumented load or store of `size` bytes at `a`; `pc` follows the call.
EMU_UNCHECKED inline __attribute__((always_inline)) void rc_access(uintptr_t a, size_t size, bool write,
                                                                    uintptr_t pc) {
    WordShadow* shadow;
    uintptr_t lo, bytes;
    bool is_static;
    if (a - (uintptr_t)dynamic_smem < MAX_DYNAMIC_SMEM) {
        shadow = rc_dynamic;
        lo = (uintptr_t)dynamic_smem;
        bytes = MAX_DYNAMIC_SMEM;
        is_static = false;
    } else if (a - rc_static_lo < rc_static_bytes) {
        shadow = rc_static;
        lo = rc_static_lo;
        bytes = rc_static_bytes;
        is_static = true;
    } else {
        return;
    }
    if (!rc_on) return;
    uintptr_t end = a + size < lo + bytes ? a + size : lo + bytes;
    for (uintptr_t word = a & ~(uintptr_t)3; word < end; word += 4) {
        unsigned from = a > word ? (unsigned)(a - word) : 0;
        unsigned to = end < word + 4 ? (unsigned)(end - word) : 4;
        uint8_t mask = (uint8_t)(((1u << to) - 1u) & ~((1u << from) - 1u));
        uintptr_t where = is_static ? word - rc_base : word - lo;
        rc_word(shadow[(word - lo) / 4], mask, write, (uint32_t)(pc - rc_base), is_static, where);
    }
}

// The block's report: empty, or one line per distinct hazard (at most 16). Code and data
// addresses are written {pc:0x..} and {data:0x..}, offsets in this library, for the host
// to resolve to source lines and variable names.
EMU_UNCHECKED std::string rc_report(const char* kernel) {
    std::string m;
    for (unsigned i = 0; i < rc_distinct; ++i) {
        const Hazard& h = rc_found[i];
        bool a_writes = std::strcmp(h.kind, "WAR") != 0;  // RAW, WAW: a wrote; WAR: a read
        bool b_writes = h.kind[0] == 'W';
        bool same_warp = (h.a_tid >> 5) == (h.b_tid >> 5);
        char where[64];
        if (h.is_static) std::snprintf(where, sizeof where, "__shared__ {data:0x%lx}", (unsigned long)h.where);
        else std::snprintf(where, sizeof where, "dynamic smem +0x%lx", (unsigned long)h.where);
        char line[400];
        std::snprintf(line, sizeof line,
                      "%srace %s in %s block (%u,%u,%u): thread %u %s %s at {pc:0x%lx}, thread %u %s it at "
                      "{pc:0x%lx} with no %s between",
                      m.empty() ? "" : "\n", h.kind, kernel, emu_block_idx.x, emu_block_idx.y, emu_block_idx.z,
                      h.a_tid, a_writes ? "wrote" : "read", where, (unsigned long)h.a_pc, h.b_tid,
                      b_writes ? "wrote" : "read", (unsigned long)h.b_pc,
                      same_warp ? "__syncwarp or __syncthreads" : "__syncthreads");
        m += line;
    }
    if (rc_more) m += "\n... and " + std::to_string(rc_more) + " more racing accesses at other call sites";
    return m;
}

#else
inline void rc_block_start() {}
inline void rc_new_epoch() {}
#endif

// A barrier has completed: the block's (`warp` < 0) or that warp's __syncwarp.
EMU_UNCHECKED inline void rc_synced(int warp) {
#ifdef EMU_RACECHECK
    if (warp < 0) rc_new_epoch();
    else ++rc_wsync[warp];
#else
    (void)warp;
#endif
}

// Runs every fiber of one block to completion. Returns an empty string, or why the block
// cannot complete (a divergent barrier).
EMU_UNCHECKED std::string run_block(Run& r) {
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
                if (op == EMU_SYNCWARP) rc_synced((int)w);
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
            rc_synced(-1);
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

EMU_UNCHECKED void set_error(char* err, size_t len, const std::string& m) {
    if (len == 0) return;
    std::snprintf(err, len, "%s", m.c_str());
}

}  // namespace

// ---------------------------------------------------------------- synchronization points

EMU_UNCHECKED static void emu_block_barrier(int site) {
    Fiber* f = current_fiber();
    f->state = AT_BLOCK;
    f->op = 0;
    f->site = site;
    yield_to_scheduler();
}

EMU_UNCHECKED static void emu_warp_barrier(int op, int site) {
    Fiber* f = current_fiber();
    f->state = AT_WARP;
    f->op = op;
    f->site = site;
    yield_to_scheduler();
}

EMU_UNCHECKED static uint64_t* emu_warp_slots(int parity) {
    return warps[emu_cur->warp].slots[parity];
}

EMU_UNCHECKED static uint32_t* emu_warp_mma_slots(int parity) {
    return warps[emu_cur->warp].mma[parity];
}

// ---------------------------------------------------------------- ThreadSanitizer's calls

// What GCC's -fsanitize=thread instrumentation calls (with function entry and exit turned
// off), answered here instead of by libtsan: loads and stores go to the race checker, the
// rest does nothing. `pc` is the call's own instruction (its return address less one).
#ifdef EMU_RACECHECK
#define EMU_TSAN extern "C" EMU_UNCHECKED __attribute__((visibility("hidden")))
#define EMU_TSAN_ACCESS(name, size, write)                                                  \
    EMU_TSAN void name(void* a) {                                                           \
        rc_access((uintptr_t)a, (size), (write), (uintptr_t)__builtin_return_address(0) - 1); \
    }
EMU_TSAN_ACCESS(__tsan_read1, 1, false)
EMU_TSAN_ACCESS(__tsan_read2, 2, false)
EMU_TSAN_ACCESS(__tsan_read4, 4, false)
EMU_TSAN_ACCESS(__tsan_read8, 8, false)
EMU_TSAN_ACCESS(__tsan_read16, 16, false)
EMU_TSAN_ACCESS(__tsan_write1, 1, true)
EMU_TSAN_ACCESS(__tsan_write2, 2, true)
EMU_TSAN_ACCESS(__tsan_write4, 4, true)
EMU_TSAN_ACCESS(__tsan_write8, 8, true)
EMU_TSAN_ACCESS(__tsan_write16, 16, true)
EMU_TSAN_ACCESS(__tsan_unaligned_read2, 2, false)
EMU_TSAN_ACCESS(__tsan_unaligned_read4, 4, false)
EMU_TSAN_ACCESS(__tsan_unaligned_read8, 8, false)
EMU_TSAN_ACCESS(__tsan_unaligned_read16, 16, false)
EMU_TSAN_ACCESS(__tsan_unaligned_write2, 2, true)
EMU_TSAN_ACCESS(__tsan_unaligned_write4, 4, true)
EMU_TSAN_ACCESS(__tsan_unaligned_write8, 8, true)
EMU_TSAN_ACCESS(__tsan_unaligned_write16, 16, true)
EMU_TSAN_ACCESS(__tsan_volatile_read1, 1, false)
EMU_TSAN_ACCESS(__tsan_volatile_read2, 2, false)
EMU_TSAN_ACCESS(__tsan_volatile_read4, 4, false)
EMU_TSAN_ACCESS(__tsan_volatile_read8, 8, false)
EMU_TSAN_ACCESS(__tsan_volatile_read16, 16, false)
EMU_TSAN_ACCESS(__tsan_volatile_write1, 1, true)
EMU_TSAN_ACCESS(__tsan_volatile_write2, 2, true)
EMU_TSAN_ACCESS(__tsan_volatile_write4, 4, true)
EMU_TSAN_ACCESS(__tsan_volatile_write8, 8, true)
EMU_TSAN_ACCESS(__tsan_volatile_write16, 16, true)
#undef EMU_TSAN_ACCESS
EMU_TSAN void __tsan_read_range(void* a, size_t n) {
    rc_access((uintptr_t)a, n, false, (uintptr_t)__builtin_return_address(0) - 1);
}
EMU_TSAN void __tsan_write_range(void* a, size_t n) {
    rc_access((uintptr_t)a, n, true, (uintptr_t)__builtin_return_address(0) - 1);
}
EMU_TSAN void __tsan_init() {}
EMU_TSAN void __tsan_func_entry(void*) {}
EMU_TSAN void __tsan_func_exit() {}
EMU_TSAN void __tsan_vptr_update(void**, void*) {}
EMU_TSAN void __tsan_vptr_read(void**) {}
#undef EMU_TSAN
#endif

// ---------------------------------------------------------------- the C interface

// Whether `entry` exists, and its parameter count (-1 when it does not).
// The host's list of the templated kernels' `__shared__` statics (offsets in this library
// and sizes), for strict mode to poison with the others before each block.
extern "C" EMU_UNCHECKED void ninfer_emu_static_shared(const uint64_t* offsets, const uint64_t* bytes, size_t n) {
    template_shared.clear();
    for (size_t i = 0; i < n; ++i) template_shared.emplace_back(offsets[i], bytes[i]);
}

extern "C" EMU_UNCHECKED int ninfer_emu_arity(const char* entry) {
    const Entry* e = find_entry(entry);
    return e ? e->arity : -1;
}

// Runs `entry` over grid (gx, gy, gz) with `block` threads and `smem` bytes of dynamic
// shared memory; `params[i]` points at argument i, as cuLaunchKernel takes them. Returns 0,
// or non-zero with a one-line reason in `err`.
extern "C" EMU_UNCHECKED int ninfer_emu_launch(const char* entry, unsigned gx, unsigned gy, unsigned gz, unsigned block,
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
                rc_block_start();
#ifdef EMU_RACECHECK
                rc_on = true;
                why = run_block(r);
                rc_on = false;
                if (why.empty()) why = rc_report(entry);
#else
                why = run_block(r);
#endif
            }
    run_now = saved;
    if (!why.empty()) {
        set_error(err, errlen, std::string("`") + entry + "`: " + why);
        return 1;
    }
    return 0;
}
