"""Speculative decoding: proposers of draft tokens and the views the sampler verifies them through.
The scheduling, KV accounting and acceptance live in the one engine (engine.scheduler, runner)."""
