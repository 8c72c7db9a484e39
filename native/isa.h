// What Dew's kernels with per-instruction-set bodies share: x86's intrinsics (DEW_X86 where they
// exist), the sets (the CPU's best found at load; the module's `set_isa` can only lower the one in use,
// so the tests run the narrower bodies on a wider CPU), and the wait for the pieces of a product that
// other threads are still finishing.
#ifndef DEW_NATIVE_ISA_H_
#define DEW_NATIVE_ISA_H_

#include <Python.h>

#include <atomic>
#include <cstdint>
#include <string>
#include <thread>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
// GCC 12's AVX-512 conversion intrinsics start from an undefined register, which its flow analysis
// reports as a read of an uninitialized value (GCC bug 105593).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>
#define DEW_X86 1
#endif

namespace dew {

enum Isa { kPortable = 0, kAvx2 = 1, kAvx512 = 2 };

inline Isa DetectIsa() {
#ifdef DEW_X86
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl"))
    return kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return kAvx2;
#endif
  return kPortable;
}

inline const char* IsaName(int isa) { return isa == kAvx512 ? "avx512" : isa == kAvx2 ? "avx2" : "portable"; }

// The module's isa(): the name of the set in use.
inline PyObject* GetIsa(const std::atomic<int>& in_use) { return PyUnicode_FromString(IsaName(in_use.load())); }

// The module's set_isa(name): `in_use` becomes the named set, at most `best`; null with Python's error set
// for a name that is none of them or beyond the CPU.
inline PyObject* SetIsa(PyObject* args, Isa best, std::atomic<int>& in_use) {
  const char* name = nullptr;
  if (!PyArg_ParseTuple(args, "s", &name)) return nullptr;
  std::string wanted(name);
  int isa = wanted == "avx512" ? kAvx512 : wanted == "avx2" ? kAvx2 : wanted == "portable" ? kPortable : -1;
  if (isa < 0) {
    PyErr_Format(PyExc_ValueError, "instruction set %R is not one of avx512, avx2, portable", PyTuple_GetItem(args, 0));
    return nullptr;
  }
  if (isa > best) {
    PyErr_Format(PyExc_ValueError, "instruction set %s is beyond this CPU's best, %s", name, IsaName(best));
    return nullptr;
  }
  in_use.store(isa);
  Py_RETURN_NONE;
}

#ifdef DEW_X86
// Whether this CPU has AMX's bfloat16 tiles and Linux lets this process use them: asked of the kernel
// (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)) at each call, so callers keep the answer.
inline bool AmxTilesAllowed() {
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) || !((edx >> 22) & 1) || !((edx >> 24) & 1)) return false;
#if defined(__linux__) && defined(SYS_arch_prctl)
  constexpr long kRequestPermission = 0x1023, kTileData = 18;
  return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
#else
  return false;
#endif
}
#endif

// Every piece is claimed; wait until `done` reaches `total`, the pieces other threads are still
// finishing (microseconds).
inline void WaitForPieces(const std::atomic<int64_t>& done, int64_t total) {
  for (int spins = 0; done.load(std::memory_order_acquire) < total; ++spins) {
#ifdef DEW_X86
    _mm_pause();
#endif
    if (spins > 4096) std::this_thread::yield();
  }
}

}  // namespace dew

#endif  // DEW_NATIVE_ISA_H_
