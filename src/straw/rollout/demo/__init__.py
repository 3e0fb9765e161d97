"""The embedded default job of ``straw demo``: a task, a policy, its trainer and its engines.

Everything here runs on the CPU with torch (``pip install 'straw[torch]'``; the HTTP server
also needs ``straw[engines]``) and is imported only by the demo and the tests, never by
``import straw.rollout``:

- :mod:`~straw.rollout.demo.task`: the synthetic copy task (JSONL prompts, a rule reward);
- :mod:`~straw.rollout.demo.policy`: a tiny mixture-of-experts transformer with seeded,
  position-addressed sampling, routes for routing replay (R3) and weight export/import;
- :mod:`~straw.rollout.demo.grpo`: group advantages and the clipped GRPO training step;
- :mod:`~straw.rollout.demo.train`: the plain in-process loop the demo is measured against;
- :mod:`~straw.rollout.demo.engine`: the continuous-batching engine loop over the policy;
- :mod:`~straw.rollout.demo.local`: that engine as an in-process Generator;
- :mod:`~straw.rollout.demo.server`: that engine behind SGLang's and vLLM's HTTP APIs (127.0.0.1);
- :mod:`~straw.rollout.demo.simulated`: an engine of fixed latency for scaling benchmarks.
"""
