"""One rank of the probe of vLLM's CPU build with expert parallelism (run by torch.distributed.run with 2 ranks): an
engine over both ranks (tensor-parallel 2, the external launcher) with `enable_expert_parallel=True`, built from the
model directory MODEL, then one generate. Prints "EP-SURVIVED" on each rank that got through.
Usage: ep_cpu_probe.py MODEL"""
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

import vllm  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402

llm = vllm.LLM(model=sys.argv[1], tokenizer=sys.argv[1], dtype="float32", seed=3, max_model_len=256,
               tensor_parallel_size=2, distributed_executor_backend="external_launcher", enable_expert_parallel=True,
               enforce_eager=True)
llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7, 8])], vllm.SamplingParams(max_tokens=4), use_tqdm=False)
print("EP-SURVIVED", flush=True)
