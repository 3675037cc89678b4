"""configs/agent_long.yaml (the 32K recipe) as a user loads it: rows of 32768 tokens split into
`context` shards that hold whole blocks and GDN chunks for the 35B model (checked by the recipe's own
`check_context_split`), the long multi-turn sources weighted above the rest, whole trajectories only,
and the tokens per optimizer step of agent_mix (so its optimizer settings carry over)."""

from pathlib import Path

from clover_jax.parallel.context import check_context_split
from sft.config import load_sft_config, model_config_from

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_agent_long_recipe():
    long, mix = load_sft_config(CONFIGS / "agent_long.yaml"), load_sft_config(CONFIGS / "agent_mix.yaml")
    m = model_config_from(long.model, None)
    assert long.data.seq_len == 32768 and long.mesh.context == 8 and long.data.overlong == "drop"
    shard = check_context_split(long.data.seq_len, long.mesh.context, m.block_sizes, m.gdn_chunk_size,
                                m.linear_conv_kernel_dim, where="agent_long")
    assert shard == 4096 and all(shard % b == 0 for b in m.block_sizes) and shard % m.gdn_chunk_size == 0
    w = {s.name: s.weight for s in long.data.sources}
    assert min(w["swe_agent"], w["tau_airline"]) > max(v for k, v in w.items() if k not in ("swe_agent", "tau_airline"))
    assert long.data.seq_len * long.data.batch_size == mix.data.seq_len * mix.data.batch_size
    assert long.data.batch_size % long.train.micro_batches == 0 and long.optimizer == mix.optimizer
