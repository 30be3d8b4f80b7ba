// A CPU emulator of the CUDA execution model, just large enough to run kernels_src/ unchanged
// with a host C++ compiler (tests only; never shipped). A launch runs its blocks one after
// another; the threads of a block are cooperative fibers (ucontext) in one OS thread, switched
// only where CUDA threads synchronise: __syncthreads and the warp collectives (shuffles, votes,
// reductions, __syncwarp), resumed in a new order each round. Sequential blocks, and lanes that
// run until they must wait for their warp, are valid CUDA schedules, so a kernel that is correct
// on a GPU computes the same here -- and a kernel that depends on an ordering CUDA does not
// promise can differ.
#pragma once
#define KVC_EMULATED 1

#include <ucontext.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

#define __device__
#define __global__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __grid_constant__
#define __shared__ static  // blocks run one at a time; kernels never read shared memory unwritten

struct uint3 { unsigned x, y, z; };
struct alignas(16) longlong2 { long long x, y; };
struct alignas(16) ulonglong2 { unsigned long long x, y; };

inline uint3 threadIdx, blockIdx, blockDim, gridDim;

template <class T> inline T __ldg(const T* p) { return *p; }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
template <class A, class B> inline auto min(A a, B b) { return a < b ? a : b; }
template <class A, class B> inline auto max(A a, B b) { return a < b ? b : a; }
template <class T> inline T atomicAdd(T* p, T v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
template <class T> inline T atomicOr(T* p, T v) { return __atomic_fetch_or(p, v, __ATOMIC_SEQ_CST); }
template <class T> inline T atomicExch(T* p, T v) { return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST); }
template <class T> inline T atomicMin(T* p, T v) {
  T old = *p;
  if (v < old) *p = v;  // fibers switch only at synchronisation points: no other thread runs here
  return old;
}
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_system() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

namespace emu {

struct Fiber {
  ucontext_t ctx;
  bool done = false;
};

constexpr size_t kStackBytes = 128 * 1024;

// Fiber stacks, allocated once per thread index and reused by every block (never zeroed: a
// fresh stack's contents are as undefined as a CUDA thread's registers).
inline char* stack_of(unsigned t) {
  static std::vector<char*> stacks;
  while (stacks.size() <= t) stacks.push_back(static_cast<char*>(std::malloc(kStackBytes)));
  return stacks[t];
}

struct Warp {
  int live = 0, arrived = 0;
  unsigned gen = 0;
  unsigned long long slot[32];
};

// The block being run: its fibers, the scheduler's context and the barrier state.
struct Block {
  std::vector<Fiber> fibers;
  ucontext_t scheduler;
  int current = 0, live = 0, arrived = 0;
  unsigned gen = 0;
  int vote = 1, vote_out[2] = {0, 0};  // __syncthreads_and: this barrier's AND, kept per generation parity
  std::vector<Warp> warps;
};

inline Block* block = nullptr;
inline const std::function<void()>* body = nullptr;

inline void yield() { swapcontext(&block->fibers[block->current].ctx, &block->scheduler); }

// Wait until every live thread of the group has arrived (generation barrier; exited threads
// leave the group, see finish()).
inline void arrive(int& arrived, int live, unsigned& gen) {
  const unsigned g = gen;
  if (++arrived >= live) {
    arrived = 0;
    ++gen;
    return;
  }
  while (gen == g) yield();
}

inline Warp& warp() { return block->warps[threadIdx.x / 32]; }

// Every lane of the warp publishes `v`; `read(slots)` runs once all have; no lane republishes
// before every lane has read.
template <class T, class R>
inline auto exchange(T v, R read) {
  Warp& w = warp();
  unsigned long long bits = 0;
  std::memcpy(&bits, &v, sizeof(T) < 8 ? sizeof(T) : 8);
  w.slot[threadIdx.x % 32] = bits;
  arrive(w.arrived, w.live, w.gen);
  auto out = read(w.slot);
  arrive(w.arrived, w.live, w.gen);
  return out;
}

template <class T>
inline T from_bits(unsigned long long bits) {
  T v;
  std::memcpy(&v, &bits, sizeof(T));
  return v;
}

inline void finish() {  // a thread returned from the kernel: it leaves its barriers
  Warp& w = warp();
  block->fibers[block->current].done = true;
  if (--w.live > 0 && w.arrived >= w.live) { w.arrived = 0; ++w.gen; }
  if (--block->live > 0 && block->arrived >= block->live) {
    block->vote_out[block->gen & 1] = block->vote;
    block->arrived = 0;
    ++block->gen;
  }
}

// The order threads resume in changes every round (a seeded walk: start and stride coprime to
// the block size), so that between two barriers a reader runs before its writer in some rounds
// and after it in others: a missing __syncthreads or __syncwarp shows up as a wrong result.
inline unsigned long long order_state = 0x9E3779B97F4A7C15ull;
inline unsigned next_order(unsigned n) {
  order_state = order_state * 6364136223846793005ull + 1442695040888963407ull;
  return (unsigned)(order_state >> 33) % n;
}
inline unsigned order_step(unsigned n) {
  for (;;) {
    const unsigned s = 1 + next_order(n);
    unsigned a = s, b = n;
    while (b) { const unsigned r = a % b; a = b; b = r; }
    if (a == 1) return s % n == 0 ? 1 : s;
  }
}

inline void entry() {
  (*body)();
  finish();
}  // returns to uc_link: the scheduler

// Run `kernel` on a grid x grid_y grid of 1-D blocks of `threads`, blocks in order (x fastest),
// fibers round-robin.
inline void launch(unsigned grid, unsigned grid_y, unsigned threads, const std::function<void()>& kernel) {
  gridDim = {grid, grid_y, 1};
  blockDim = {threads, 1, 1};
  body = &kernel;
  for (unsigned b = 0; b < grid * grid_y; ++b) {
    Block blk;
    blk.fibers.resize(threads);
    blk.live = (int)threads;
    blk.warps.resize((threads + 31) / 32);
    for (unsigned t = 0; t < threads; ++t) blk.warps[t / 32].live++;
    block = &blk;
    blockIdx = {b % grid, b / grid, 0};
    for (unsigned t = 0; t < threads; ++t) {
      Fiber& f = blk.fibers[t];
      getcontext(&f.ctx);
      f.ctx.uc_stack.ss_sp = stack_of(t);
      f.ctx.uc_stack.ss_size = kStackBytes;
      f.ctx.uc_link = &blk.scheduler;
      makecontext(&f.ctx, entry, 0);
    }
    for (bool any = true; any;) {  // rounds until every thread has returned
      any = false;
      const unsigned start = next_order(threads), step = order_step(threads);
      for (unsigned i = 0, t = start; i < threads; ++i, t = (t + step) % threads) {
        if (blk.fibers[t].done) continue;
        any = true;
        blk.current = (int)t;
        threadIdx = {t, 0, 0};
        swapcontext(&blk.scheduler, &blk.fibers[t].ctx);
      }
    }
    block = nullptr;
  }
}

}  // namespace emu

inline void __syncthreads() { emu::arrive(emu::block->arrived, emu::block->live, emu::block->gen); }
// The last thread to arrive publishes the AND before releasing the barrier; a thread cannot reach
// the barrier after next (and overwrite this parity) before every thread has read it.
inline int __syncthreads_and(int pred) {
  emu::Block& b = *emu::block;
  const unsigned g = b.gen;
  if (b.arrived == 0) b.vote = 1;
  b.vote &= pred != 0;
  if (b.arrived + 1 >= b.live) b.vote_out[g & 1] = b.vote;
  emu::arrive(b.arrived, b.live, b.gen);
  return b.vote_out[g & 1];
}
inline void __syncwarp(unsigned = 0xffffffffu) {
  emu::Warp& w = emu::warp();
  emu::arrive(w.arrived, w.live, w.gen);
}

template <class T>
inline T __shfl_sync(unsigned, T v, int src) {
  return emu::exchange(v, [&](const unsigned long long* s) { return emu::from_bits<T>(s[src & 31]); });
}

template <class T>
inline T __shfl_up_sync(unsigned, T v, unsigned d) {
  const int lane = threadIdx.x % 32;
  return emu::exchange(v, [&](const unsigned long long* s) {
    return lane >= (int)d ? emu::from_bits<T>(s[lane - d]) : v;
  });
}

namespace emu {
// `op` folded over the values the warp's live lanes published (exited lanes take no part).
template <class Op>
inline unsigned fold_warp(unsigned v, unsigned init, Op op) {
  const unsigned base = threadIdx.x / 32 * 32;
  return exchange((unsigned long long)v, [&](const unsigned long long* s) {
    unsigned acc = init;
    for (unsigned l = 0; l < 32; ++l)
      if (base + l < blockDim.x && !block->fibers[base + l].done) acc = op(acc, (unsigned)s[l], l);
    return acc;
  });
}
}  // namespace emu

inline unsigned __ballot_sync(unsigned, int pred) {
  return emu::fold_warp(pred != 0, 0u, [](unsigned m, unsigned x, unsigned l) { return x ? m | 1u << l : m; });
}

inline unsigned __reduce_add_sync(unsigned, unsigned v) {
  return emu::fold_warp(v, 0u, [](unsigned a, unsigned x, unsigned) { return a + x; });
}

inline unsigned __reduce_max_sync(unsigned, unsigned v) {
  return emu::fold_warp(v, 0u, [](unsigned a, unsigned x, unsigned) { return x > a ? x : a; });
}
