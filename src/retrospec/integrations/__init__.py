"""Our drafters inside other engines (``vllm_proposer``: a vLLM speculative-decoding proposer)."""
