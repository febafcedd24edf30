"""The native CPU kernels under AddressSanitizer + UBSan and under ThreadSanitizer.

The kernels read memory at page ids, lengths and shapes that come from arrays:
a bad one must never reach memory outside its buffers, and their threads must
not race (XLA would not notice; the process would die later, or give wrong
numbers). tests/native_cpu_check.cc runs each kernel's random cases
(tests/*_cpu_check.cc) in one program, built once per sanitizer.
"""

import pathlib

from absl.testing import absltest
from absl.testing import parameterized
import pytest

from kvjax import testing


@pytest.mark.slow  # about 70 s: the C++ kernels rebuilt and run under each sanitizer
class SanitizerTest(parameterized.TestCase):

  @parameterized.parameters("address,undefined", "thread")
  def test_no_bad_access_or_race(self, sanitizers):
    done = testing.run_under_sanitizers(
        pathlib.Path(__file__).with_name("native_cpu_check.cc"), sanitizers)
    self.assertEqual(done.returncode, 0, done.stdout + done.stderr[-3000:])
    self.assertEqual(done.stdout.split("\n")[:3], [
        "paged attention: 300 cases", "causal attention: 60 cases", "quantized matmul: 200 cases"])


if __name__ == "__main__":
  absltest.main()
