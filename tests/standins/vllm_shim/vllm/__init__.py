"""`import vllm` in a process the tests start but do not control (rollout.mode=one_step_off's sampler process, which
inherits the test's sys.path): the stand-in of tests/standins/fake_vllm.py as vLLM's CPU build."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import fake_vllm  # noqa: E402

fake_vllm.FakeLLM.platform = "cpu"
sys.modules.update(fake_vllm.modules())  # this import then answers with the stand-in's `vllm`
