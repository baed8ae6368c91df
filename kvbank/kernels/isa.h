// The one registry of instruction-set levels for kvbank's native kernels.
//
// A level names a set of x86 features, each level holding the ones below it:
//   scalar       plain C++ (any CPU; the reference every family is tested against)
//   avx2         AVX2, FMA, F16C                                  (Zen 2/3, Intel client chips)
//   avx512       + AVX-512 F/BW/DQ/VL                             (Skylake-SP)
//   avx512_vnni  + AVX-512 VNNI                                   (Cascade Lake, Ice Lake)
//   avx512_bf16  + AVX-512 BF16 and VBMI                          (Sapphire Rapids, Zen 4)
//   amx          + AMX-TILE and AMX-INT8, granted by the OS          (Sapphire Rapids and later)
// Every kernel family lists the levels it has a variant for; a call runs the family's best variant
// at or below the active level: the CPU's own, capped by KVBANK_ISA (set_isa_cap), never above what
// the CPU has. So every variant can be run and tested on a machine that has its features, and the
// variant in use is a fact that can be reported rather than guessed.
#pragma once

#include <algorithm>
#include <atomic>
#include <string>
#include <vector>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
// Compilers that know AMX's tile instructions (GCC 11, clang 12 and later) build the amx variants.
#if (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11)
#define KVBANK_AMX_BUILD 1
#endif
#endif

namespace kvbank {

enum class Isa : int { Scalar = 0, Avx2 = 1, Avx512 = 2, Avx512Vnni = 3, Avx512Bf16 = 4, Amx = 5 };
constexpr int kIsaLevels = 6;

inline const char* isa_name(Isa isa) {
  static const char* const names[kIsaLevels] = {"scalar", "avx2", "avx512", "avx512_vnni", "avx512_bf16", "amx"};
  return names[static_cast<int>(isa)];
}

// The level called `name`; false for an unknown name.
inline bool isa_from_name(const std::string& name, Isa* out) {
  for (int i = 0; i < kIsaLevels; ++i) {
    if (name == isa_name(static_cast<Isa>(i))) {
      *out = static_cast<Isa>(i);
      return true;
    }
  }
  return false;
}

// Whether AMX's int8 tiles can run here: the CPU has AMX-TILE and AMX-INT8, the OS saves tile state
// (XCR0 bits 17 and 18) and, on Linux, grants this process the tile data (arch_prctl
// ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA; without it the first tile instruction faults).
inline bool amx_usable() {
#if defined(KVBANK_AMX_BUILD) && defined(__linux__)
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  if (!((edx >> 24) & 1u) || !((edx >> 25) & 1u)) return false;  // AMX-TILE, AMX-INT8
  if (!__get_cpuid(1, &eax, &ebx, &ecx, &edx) || !((ecx >> 27) & 1u)) return false;  // OSXSAVE
  unsigned xcr0_lo = 0, xcr0_hi = 0;
  __asm__ volatile("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
  if ((xcr0_lo & (3u << 17)) != (3u << 17)) return false;  // XTILECFG and XTILEDATA enabled
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}

// The highest level this CPU runs, detected once.
inline Isa cpu_isa() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  static const Isa level = [] {
    __builtin_cpu_init();
#define KVBANK_HAS(feature) __builtin_cpu_supports(feature)
    if (!(KVBANK_HAS("avx2") && KVBANK_HAS("fma") && KVBANK_HAS("f16c"))) return Isa::Scalar;
    if (!(KVBANK_HAS("avx512f") && KVBANK_HAS("avx512bw") && KVBANK_HAS("avx512dq") && KVBANK_HAS("avx512vl")))
      return Isa::Avx2;
    if (!KVBANK_HAS("avx512vnni")) return Isa::Avx512;
    if (!(KVBANK_HAS("avx512bf16") && KVBANK_HAS("avx512vbmi"))) return Isa::Avx512Vnni;
#undef KVBANK_HAS
    if (!amx_usable()) return Isa::Avx512Bf16;
    return Isa::Amx;
  }();
  return level;
#else
  return Isa::Scalar;
#endif
}

inline std::atomic<int>& isa_cap_storage() {
  static std::atomic<int> cap{kIsaLevels - 1};
  return cap;
}

// The level kernels run at: the CPU's, capped.
inline Isa active_isa() {
  const int cap = isa_cap_storage().load(std::memory_order_relaxed);
  return static_cast<Isa>(std::min(cap, static_cast<int>(cpu_isa())));
}

// Cap the level kernels use (a cap above the CPU's level leaves the CPU's).
inline void set_isa_cap(Isa cap) { isa_cap_storage().store(static_cast<int>(cap), std::memory_order_relaxed); }

// The kernel families and the levels each has a variant for (lowest first).
enum class Family : int { Matmul = 0, DenseAttention = 1, QuantAttention = 2, QuantWrite = 3, Activation = 4, Sampling = 5 };
constexpr int kFamilies = 6;

struct FamilyInfo {
  const char* name;
  std::vector<Isa> variants;
};

inline const FamilyInfo& family_info(Family family) {
  static const FamilyInfo families[kFamilies] = {
      // integer GGUF matmuls, and the one-call decoder stack built on them (matmul*.cpp, stack.cpp; amx: int8
      // tiles for 16 rows at a time, the avx512_vnni kernels for the rest, the same bits)
      {"matmul", {Isa::Scalar, Isa::Avx2, Isa::Avx512Vnni, Isa::Amx}},
      // decode and row attention over a bfloat16 paged cache (dense_attention.cpp)
      {"dense_attention", {Isa::Scalar, Isa::Avx2, Isa::Avx512, Isa::Avx512Bf16}},
      // attention read in place from int8/fp8/int4/int2 caches (quant_attention*.cpp)
      {"quant_attention", {Isa::Scalar, Isa::Avx2, Isa::Avx512, Isa::Avx512Bf16}},
      // int8/fp8 and int4/int2 cache writes (cache_write.cpp)
      {"quant_write", {Isa::Scalar, Isa::Avx2}},
      // silu(gate) * up of the fused MLP, and the stack's residual adds, norm scaling and stores (fused.cpp)
      {"activation", {Isa::Scalar, Isa::Avx2, Isa::Avx512}},
      // greedy sampling: each row's first largest logit (sampling.cpp)
      {"sampling", {Isa::Scalar, Isa::Avx2, Isa::Avx512}},
  };
  return families[static_cast<int>(family)];
}

// Whether `family` has a variant for exactly `level`.
inline bool family_has_variant(Family family, Isa level) {
  const std::vector<Isa>& variants = family_info(family).variants;
  return std::find(variants.begin(), variants.end(), level) != variants.end();
}

// The names a kernel's isa argument takes for `family`, as its error messages list them: "auto, "
// then the family's levels, lowest first or highest first, the last after "or".
inline std::string family_isa_choices(Family family, bool highest_first) {
  std::vector<Isa> levels = family_info(family).variants;
  if (highest_first) std::reverse(levels.begin(), levels.end());
  std::string text = "auto";
  for (size_t i = 0; i < levels.size(); ++i)
    text += std::string(i + 1 < levels.size() ? ", " : " or ") + isa_name(levels[i]);
  return text;
}

// The variant `family` runs at `level`: its best one at or below it; false when it has none.
inline bool family_variant_at(Family family, Isa level, Isa* out) {
  bool found = false;
  for (Isa v : family_info(family).variants) {
    if (static_cast<int>(v) <= static_cast<int>(level)) {
      *out = v;
      found = true;
    }
  }
  return found;
}

// The variant `family` runs now; false when it has none at the active level.
inline bool family_variant(Family family, Isa* out) { return family_variant_at(family, active_isa(), out); }

// Whether `family` runs natively at the active level.
inline bool family_available(Family family) {
  Isa unused;
  return family_variant(family, &unused);
}

}  // namespace kvbank
