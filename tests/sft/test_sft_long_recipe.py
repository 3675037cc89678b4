"""configs/agent_long.yaml (the 32K recipe) as a user loads it: rows of 32768 tokens split into
`context` shards that hold whole blocks and GDN chunks for the 35B model (checked by the recipe's own
`check_context_split`), the long multi-turn sources weighted above the rest, whole trajectories only,
and the tokens per optimizer step of agent_mix (so its optimizer settings carry over)."""

from pathlib import Path

from pallas_kernels.context.split import check_context_split
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
    assert m.context_layout == "zigzag"  # every context shard the same causal share of attention


def test_agent_long_128k_recipe():
    """configs/agent_long_128k.yaml: agent_long at 131072 tokens per row over 32 context shards of 4096
    tokens, the same sources and optimizer, agent_mix's tokens per step; on v5p-256 (128 chips) the
    free fsdp axis is 4, so each batch shard holds exactly one row (one 4096-token piece per chip, as
    agent_long's v5p-128 plan)."""
    long, big = load_sft_config(CONFIGS / "agent_long.yaml"), load_sft_config(CONFIGS / "agent_long_128k.yaml")
    mix = load_sft_config(CONFIGS / "agent_mix.yaml")
    m = model_config_from(big.model, None)
    assert big.data.seq_len == 131072 and big.mesh.context == 32
    shard = check_context_split(big.data.seq_len, big.mesh.context, m.block_sizes, m.gdn_chunk_size,
                                m.linear_conv_kernel_dim, where="agent_long_128k")
    assert shard == 4096
    assert big.data.sources == long.data.sources and big.optimizer == long.optimizer and big.data.overlong == "drop"
    assert big.data.seq_len * big.data.batch_size == mix.data.seq_len * mix.data.batch_size
    sizes = big.mesh.axis_sizes(128)
    assert sizes["fsdp"] == 4 and sizes["context"] == 32
    assert big.data.batch_size // big.train.micro_batches == sizes["data"] * sizes["fsdp"] * sizes["expert"]
