"""What the continuous engine reads of the service's Settings, taken once where the engine is built
(engine.build) and passed down to the engine, its scheduler and the model code.

The service's Settings hold the API's, Redis' and the worker loop's settings too; the engine sees
only these, so what can change a step's plan or a product's numbers is listed in one place. The
defaults and their documentation stay with Settings (shared/settings.py): this copies, never sets.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from shared.settings import Settings


@dataclass(frozen=True)
class EngineConfig:
    # The paged KV cache
    block_size: int
    kv_blocks: int  # 0: as many as kv_memory holds
    kv_memory: int  # MiB
    kv_dtype: str  # auto | model | float16 | bfloat16 (engine.cache_dtype resolves it)
    dtype: str  # the dtype asked for (auto: the hardware's choice), which kv_dtype auto follows
    prefix_caching: bool
    # The scheduler
    batch: int  # most running requests (0: as many as the cache and the step budget allow)
    max_batch_tokens: int
    prefill_chunk: int
    step_fill: int
    max_stretch: float
    scheduler: str  # its policy: fifo | prefill-first
    jump_forward: bool  # a grammar's forced tokens appended without a step each
    # The products (worker/continuous/linear.py)
    int4_rows: int  # 0 off the CPU: a GPU runs torch's products
    int4_head: bool
    small_kernel: str
    huge_pages: bool  # the weights in 2 MiB pages (worker/continuous/huge_pages.py)
    kernel_isa: str  # native | avx2: what the C++ kernels are built for (kernels.ISAS)
    cache_dir: str  # where the C++ kernels are built and kept

    @classmethod
    def from_settings(cls, settings: Settings, cpu: bool = True) -> "EngineConfig":
        values = {f.name: getattr(settings, f.name) for f in fields(cls)}
        if not cpu:
            values["int4_rows"] = 0
        return cls(**values)
