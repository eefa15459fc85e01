"""LLM text encoders under ZeRO-3 (Qwen2.5-VL here; Qwen3, Llama and Mistral share the
mechanics): loaded straight into partitions from a checkpoint that transformers 5 saved under
older key names, sharded in bf16 with their rotary tables kept in fp32, and giving the
unsharded model's outputs, on 2 ranks."""

from __future__ import annotations

import pytest
import torch

from tests.distributed_harness import run_on_ranks


def worker_sharded_llm_encoder(pipe_dir: str):
    from transformers import Qwen2_5_VLForConditionalGeneration

    from diffusers_zero3.families import QWENIMAGE
    from diffusers_zero3.placement.frozen import load_frozen_component
    from diffusers_zero3.runtime.zero3 import zero3_init_disabled
    from tests.common import accelerator_with_zero3

    accelerator = accelerator_with_zero3()  # persistence threshold 0: every tensor partitioned
    tokenizers = QWENIMAGE.load_tokenizers(pipe_dir)
    prompts = ["a red circle", "a blue square on grey"] if torch.distributed.get_rank() == 0 else ["a cat"]
    ids = QWENIMAGE.tokenize(tokenizers, prompts, 16)
    with zero3_init_disabled():
        plain = Qwen2_5_VLForConditionalGeneration.from_pretrained(pipe_dir, subfolder="text_encoder")
    reference = {
        n: b.clone() for n, b in plain.named_buffers() if n.endswith("inv_freq") and "visual" not in n
    }
    with torch.no_grad():
        expected = QWENIMAGE.encode_texts({"text_encoder": plain}, ids)
    for dtype in (torch.float32, torch.bfloat16):
        sharded = load_frozen_component(
            accelerator, pipe_dir, "text_encoder", "shard", Qwen2_5_VLForConditionalGeneration, dtype=dtype
        )
        assert sharded.placement == "shard"
        buffers = dict(sharded.module.named_buffers())
        rounded = [
            n
            for n in reference
            if buffers[n].dtype != torch.float32 or not torch.equal(buffers[n], reference[n])
        ]
        assert not rounded, rounded
        with torch.no_grad():
            got = QWENIMAGE.encode_texts({"text_encoder": sharded}, ids)
        tolerance = {"atol": 1e-6, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-2}
        torch.testing.assert_close(got["prompt_embeds"].float(), expected["prompt_embeds"], **tolerance)
        assert torch.equal(got["prompt_embeds_mask"], expected["prompt_embeds_mask"])
        sharded.release()
    print("OK sharded llm encoder")


@pytest.mark.multirank
def test_sharded_llm_encoder_loads_renamed_keys_and_keeps_fp32_rotary_tables(tiny_qwenimage):
    """(The positive control of the rotary tables, a default zero.Init build that rounds them,
    is in test_init_state.py.)"""
    outs = run_on_ranks(worker_sharded_llm_encoder, pipe_dir=tiny_qwenimage[0], timeout=240)
    assert all("OK sharded llm encoder" in o for o in outs), outs


def worker_padding_idx_model_loads_partitioned(folder: str):
    from transformers import LlamaModel

    from diffusers_zero3 import load_pretrained_zero3
    from tests.common import accelerator_with_zero3

    accelerator = accelerator_with_zero3()
    model = load_pretrained_zero3(LlamaModel, folder, accelerator=accelerator)
    assert model.embed_tokens.padding_idx == 0
    from diffusers_zero3 import gathered_parameters

    reference = LlamaModel.from_pretrained(folder)
    with gathered_parameters(list(model.parameters())):
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            assert torch.equal(p, q), name
    print("OK padding_idx")


@pytest.mark.multirank
def test_a_model_with_a_padding_index_loads_into_partitions(tmp_path):
    """An embedding with ``padding_idx`` (a config's ``pad_token_id``, as Mistral's): transformers'
    weight init writes its padding row after zero.Init has partitioned it."""
    from transformers import LlamaConfig, LlamaModel

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, pad_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    LlamaModel(config).save_pretrained(tmp_path / "llama")
    outs = run_on_ranks(
        worker_padding_idx_model_loads_partitioned, folder=str(tmp_path / "llama"), timeout=180
    )
    assert all("OK padding_idx" in o for o in outs)
