"""Other engines treedec drives on the same model, heads and prompts: vLLM (:mod:`.vllm`), run in a child process
(:mod:`.vllm_worker`) so that its process-wide settings (thread binding, a replaced ``torch.set_num_threads``,
its metrics registry) never reach treedec's own process."""
