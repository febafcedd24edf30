// Memory-safety and thread checks of the native CPU kernels (kernels/*_cpu.cc),
// built once with AddressSanitizer and UBSan and once with ThreadSanitizer by
// tests/test_native_sanitizers.py: each kernel's check (tests/*_cpu_check.cc)
// runs random shapes, every buffer its own heap allocation of exactly its size,
// 1-4 threads, and prints "<kernel>: <n> cases" when they pass. Exits non-zero
// at the first failure (the sanitizers stop the run at the first report).

#include "causal_attention_cpu_check.cc"
#include "paged_attention_cpu_check.cc"
#include "quantized_matmul_cpu_check.cc"

int main() {
  if (CheckPagedAttention() != 0) return 1;
  if (CheckCausalAttention() != 0) return 1;
  return CheckQuantizedMatmul();
}
