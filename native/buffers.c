/* Big aligned buffers kept for the next request instead of unmapped: a library a process loads with
 * LD_PRELOAD, not a Python module. Nothing in Dew preloads it: `dew launch` preloads jemalloc or
 * tcmalloc, which keep freed blocks the same way (dew.kernels.process).
 *
 * XLA's CPU runtime asks posix_memalign for a compiled step's temporaries, one block of tens to
 * hundreds of MiB per execution, and frees it when the step ends. glibc maps any block above its
 * largest mmap threshold (32 MiB) afresh and unmaps it on free, so every step faults the whole block
 * in again and the kernel clears every page of it. Here a freed block of at least kSmallest bytes
 * stays mapped, up to 1/kIdleShare of physical memory in all, and the next request of about its size
 * takes it back, its pages already present (docs/performance.md measures both). Every other request,
 * and every free of a pointer that is not one of these blocks, goes to the C library as before. Like
 * glibc's, the blocks are not cleared between uses (posix_memalign promises no contents); calloc and
 * malloc are not intercepted. */

#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <malloc.h>
#include <stdlib.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define kSlots 32
static const size_t kSmallest = (size_t)32 << 20;  /* glibc maps blocks above this afresh each time */
static const size_t kHuge = (size_t)2 << 20;       /* a transparent huge page: blocks are whole ones */
static const size_t kIdleShare = 8;                /* idle blocks hold at most 1/8 of physical memory */

typedef struct {
  _Atomic(uintptr_t) start; /* what the caller was given; 0: the slot is empty */
  size_t bytes;             /* mapped, from start */
  int busy;                 /* handed out and not yet freed */
} Block;

static Block blocks[kSlots];
static _Atomic int slots_used; /* blocks[0 .. slots_used) may be non-empty: free scans no further */
static size_t idle_bytes, idle_limit;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

/* The C library's own functions this library stands in front of, looked up on first use: other
 * libraries' constructors may allocate before this one's would run. posix_memalign needs none: below
 * kSmallest it is memalign's answer, which is how glibc defines it. */
static void (*_Atomic next_free)(void *);
static void *(*_Atomic next_realloc)(void *, size_t);
static size_t (*_Atomic next_usable_size)(void *);
static __thread int resolving; /* dlsym may free: that free must not look the names up again */

static void resolve(void) {
  if (resolving) return;
  resolving = 1;
  next_free = (void (*)(void *))dlsym(RTLD_NEXT, "free");
  next_realloc = (void *(*)(void *, size_t))dlsym(RTLD_NEXT, "realloc");
  next_usable_size = (size_t(*)(void *))dlsym(RTLD_NEXT, "malloc_usable_size");
  resolving = 0;
}

/* A fork while another thread holds the lock would leave the child's copy locked for good. */
static void lock_for_fork(void) { pthread_mutex_lock(&lock); }
static void unlock_after_fork(void) { pthread_mutex_unlock(&lock); }

__attribute__((constructor)) static void start(void) {
  pthread_atfork(lock_for_fork, unlock_after_fork, unlock_after_fork);
  long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  idle_limit = pages > 0 && page > 0 ? (size_t)pages * (size_t)page / kIdleShare : 0;
  if (!next_free) resolve();
}

/* The slot holding `pointer`, -1 for any other pointer. Reads without the lock: a slot's start is set
 * before its block is handed out and cleared before it is unmapped, so no other pointer can match. */
static int slot_of(const void *pointer) {
  int used = atomic_load_explicit(&slots_used, memory_order_acquire);
  for (int i = 0; i < used; ++i)
    if (atomic_load_explicit(&blocks[i].start, memory_order_acquire) == (uintptr_t)pointer) return i;
  return -1;
}

/* A new mapping of `bytes` (a multiple of kHuge) starting on a huge-page boundary, or NULL. */
static void *map_block(size_t bytes) {
  char *mapped = mmap(NULL, bytes + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mapped == MAP_FAILED) return NULL;
  char *start = (char *)(((uintptr_t)mapped + kHuge - 1) & ~(uintptr_t)(kHuge - 1));
  if (start > mapped) munmap(mapped, (size_t)(start - mapped));
  size_t tail = (size_t)(mapped + bytes + kHuge - (start + bytes));
  if (tail) munmap(start + bytes, tail);
  madvise(start, bytes, MADV_HUGEPAGE); /* where the kernel gives them on request; ignored elsewhere */
  return start;
}

/* A block of at least `size` bytes: an idle one no more than an eighth larger, else a new mapping in
 * an empty slot (or in the slot of an idle block that fits no request like this one, unmapped);
 * NULL where none of these (the caller falls back to the C library). */
static void *take_block(size_t size) {
  size_t bytes = (size + kHuge - 1) & ~(kHuge - 1);
  void *found = NULL;
  pthread_mutex_lock(&lock);
  int best = -1, empty = -1, unfit = -1;
  for (int i = 0; i < kSlots; ++i) {
    uintptr_t start = atomic_load_explicit(&blocks[i].start, memory_order_relaxed);
    if (!start) {
      if (empty < 0) empty = i;
    } else if (blocks[i].busy) {
      continue;
    } else if (blocks[i].bytes >= bytes && blocks[i].bytes - bytes <= bytes / 8) {
      if (best < 0 || blocks[i].bytes < blocks[best].bytes) best = i;
    } else if (unfit < 0 || blocks[i].bytes > blocks[unfit].bytes) {
      unfit = i;
    }
  }
  if (best < 0 && empty < 0 && unfit >= 0) {
    void *start = (void *)atomic_load_explicit(&blocks[unfit].start, memory_order_relaxed);
    atomic_store_explicit(&blocks[unfit].start, 0, memory_order_release);
    idle_bytes -= blocks[unfit].bytes;
    munmap(start, blocks[unfit].bytes);
    empty = unfit;
  }
  if (best >= 0) {
    blocks[best].busy = 1;
    idle_bytes -= blocks[best].bytes;
    found = (void *)atomic_load_explicit(&blocks[best].start, memory_order_relaxed);
  } else if (empty >= 0 && (found = map_block(bytes)) != NULL) {
    blocks[empty].bytes = bytes;
    blocks[empty].busy = 1;
    atomic_store_explicit(&blocks[empty].start, (uintptr_t)found, memory_order_release);
    if (empty >= atomic_load_explicit(&slots_used, memory_order_relaxed))
      atomic_store_explicit(&slots_used, empty + 1, memory_order_release);
  }
  pthread_mutex_unlock(&lock);
  return found;
}

/* Slot `i`'s block is free again: kept idle while idle blocks stay within the limit, else unmapped. */
static void give_back(int i) {
  pthread_mutex_lock(&lock);
  void *start = (void *)atomic_load_explicit(&blocks[i].start, memory_order_relaxed);
  if (idle_bytes + blocks[i].bytes <= idle_limit) {
    blocks[i].busy = 0;
    idle_bytes += blocks[i].bytes;
  } else {
    atomic_store_explicit(&blocks[i].start, 0, memory_order_release);
    blocks[i].busy = 0;
    munmap(start, blocks[i].bytes);
  }
  pthread_mutex_unlock(&lock);
}

__attribute__((visibility("default"))) int posix_memalign(void **out, size_t alignment, size_t size) {
  if (size >= kSmallest && alignment <= kHuge && alignment >= sizeof(void *) && !(alignment & (alignment - 1))) {
    void *block = take_block(size);
    if (block) {
      *out = block;
      return 0;
    }
  }
  if (alignment < sizeof(void *) || (alignment & (alignment - 1))) return EINVAL;
  void *block = memalign(alignment, size);
  if (!block) return ENOMEM;
  *out = block;
  return 0;
}

__attribute__((visibility("default"))) void free(void *pointer) {
  if (!pointer) return;
  int i = slot_of(pointer);
  if (i >= 0) {
    give_back(i);
    return;
  }
  if (!next_free) resolve();
  if (next_free) next_free(pointer); /* else freed inside dlsym's own lookup of it: left (bytes, once) */
}

__attribute__((visibility("default"))) void *realloc(void *pointer, size_t size) {
  int i = pointer ? slot_of(pointer) : -1;
  if (!next_realloc) resolve();
  if (i < 0) return next_realloc ? next_realloc(pointer, size) : NULL;
  if (size <= blocks[i].bytes) return pointer;
  void *moved = malloc(size);
  if (moved) {
    memcpy(moved, pointer, blocks[i].bytes);
    give_back(i);
  }
  return moved;
}

__attribute__((visibility("default"))) size_t malloc_usable_size(void *pointer) {
  int i = pointer ? slot_of(pointer) : -1;
  if (i >= 0) return blocks[i].bytes;
  if (!next_usable_size) resolve();
  return next_usable_size ? next_usable_size(pointer) : 0;
}
