"""The scheduler pod's engine.

Where a request goes, in order:
    batch_scheduler.BatchScheduler   waiting queue -> schedule() -> batch -> process()
      policy/schedule_policy.py      the order waiting requests are offered in (lpm, fcfs, dfs-weight)
      policy/prefill_adder.py        which of them fit this step's budgets (chunked prefill)
      batch.py                the batch handed to the model runner
      memory/manager.py              KV slots for requests: allocator + ReqToTokenPool + cache
      memory/radix_cache.py          the prefix cache (ownership diagram at the top)
"""
