"""Partitioned load and streamed consolidated save (single process and 2 ZeRO-3 ranks)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.distributed_harness import run_on_ranks


def _assert_same_weights(a: torch.nn.Module, b: torch.nn.Module):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], msg=k)


# --------------------------------------------------------------------------- single process


@pytest.mark.unit
def test_save_plain_module_round_trips_sharded_and_not(tiny_pipeline, tmp_path):
    from diffusers import UNet2DConditionModel

    from diffusers_zero3.state.pretrained import save_pretrained_zero3

    unet = UNet2DConditionModel.from_pretrained(tiny_pipeline, subfolder="unet")
    save_pretrained_zero3(unet, tmp_path / "one")
    assert (tmp_path / "one" / "diffusion_pytorch_model.safetensors").exists()
    _assert_same_weights(UNet2DConditionModel.from_pretrained(tmp_path / "one"), unet)

    save_pretrained_zero3(unet, tmp_path / "many", max_shard_size="1MB")
    index = json.loads((tmp_path / "many" / "diffusion_pytorch_model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(unet.state_dict())
    files = set(index["weight_map"].values())
    assert len(files) > 1 and all((tmp_path / "many" / f).exists() for f in files)
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in unet.state_dict().values())
    _assert_same_weights(UNet2DConditionModel.from_pretrained(tmp_path / "many"), unet)

    save_pretrained_zero3(unet, tmp_path / "bf16", dtype=torch.bfloat16)
    loaded = UNet2DConditionModel.from_pretrained(tmp_path / "bf16", torch_dtype=torch.bfloat16)
    assert loaded.dtype == torch.bfloat16


@pytest.mark.unit
def test_interrupted_save_leaves_previous_folder_and_no_temp(tiny_pipeline, tmp_path, monkeypatch):
    from diffusers import UNet2DConditionModel

    import diffusers_zero3.state.pretrained as ckpt

    unet = UNet2DConditionModel.from_pretrained(tiny_pipeline, subfolder="unet")
    target = tmp_path / "out"
    ckpt.save_pretrained_zero3(unet, target)
    before = sorted(p.name for p in target.iterdir())

    calls = {"n": 0}
    real = ckpt._write_tensor

    def interrupted(fh, tensor, dtype):
        calls["n"] += 1
        if calls["n"] == 5:
            raise KeyboardInterrupt  # e.g. the job is killed mid-save
        return real(fh, tensor, dtype)

    monkeypatch.setattr(ckpt, "_write_tensor", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_pretrained_zero3(unet, target)
    assert sorted(p.name for p in target.iterdir()) == before
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no .tmp-* folder left
    calls["n"] = 0
    with pytest.raises(KeyboardInterrupt):
        ckpt.save_pretrained_zero3(unet, tmp_path / "fresh")
    assert not (tmp_path / "fresh").exists()


@pytest.mark.unit
def test_missing_model_folder_is_a_clear_error(tmp_path):
    from diffusers import UNet2DConditionModel

    from diffusers_zero3.state.pretrained import CheckpointError, load_pretrained_zero3

    with pytest.raises(CheckpointError, match="does not exist"):
        load_pretrained_zero3(UNet2DConditionModel, str(tmp_path / "nope"), "unet")


# --------------------------------------------------------------------------- 2 ranks


def worker_load_and_save(pipe_dir: str, work: str):
    import deepspeed
    from diffusers import UNet2DConditionModel
    from safetensors.torch import load_file, save_file
    from transformers import CLIPTextModel

    import diffusers_zero3.state.pretrained as ckpt
    from diffusers_zero3 import get_rank, zero3_init_disabled
    from diffusers_zero3.state.pretrained import CheckpointError, load_pretrained_zero3, save_pretrained_zero3
    from tests.common import zero3_config

    deepspeed.init_distributed(dist_backend="gloo")
    cfg = zero3_config(stage3_param_persistence_threshold=200)  # small biases kept whole

    # What the partitioned load reads: never a whole (non-persistent) tensor.
    reads = []
    real_read = ckpt._read_flat_range

    def spy(path, start, info, lo, hi, out=None):
        reads.append((hi - lo, info["shape"]))
        return real_read(path, start, info, lo, hi, out=out)

    # ... and no parameter broadcast whole from rank 0 (zero.Init's default, counted by the
    # control: a plain zero.Init build broadcasts every parameter).
    from deepspeed.runtime.zero import partition_parameters

    broadcasts = []
    real_broadcast = partition_parameters.dist.broadcast

    def count_broadcast(tensor, *args, **kwargs):
        broadcasts.append(tensor.numel())
        return real_broadcast(tensor, *args, **kwargs)

    ckpt._read_flat_range = spy
    partition_parameters.dist.broadcast = count_broadcast
    try:
        ours = load_pretrained_zero3(UNet2DConditionModel, pipe_dir, "unet", ds_config=cfg)
        assert broadcasts == [], len(broadcasts)
        with deepspeed.zero.Init(config_dict_or_path=cfg):
            control = UNet2DConditionModel.from_config(
                UNet2DConditionModel.load_config(pipe_dir, subfolder="unet")
            )
        assert len(broadcasts) == len(list(control.parameters())), (
            len(broadcasts),
            len(list(control.parameters())),
        )
    finally:
        ckpt._read_flat_range = real_read
        partition_parameters.dist.broadcast = real_broadcast
    del control
    big_reads = [(n, shape) for n, shape in reads if torch.Size(shape).numel() > 200]
    assert big_reads and all(n <= (torch.Size(s).numel() + 1) // 2 for n, s in big_reads), big_reads[:5]

    with zero3_init_disabled():
        ref = UNet2DConditionModel.from_pretrained(pipe_dir, subfolder="unet")
    ref_engine, *_ = deepspeed.initialize(model=ref, config=cfg)
    ours_engine, *_ = deepspeed.initialize(model=ours, config=cfg)
    for (name, a), (_, b) in zip(ours_engine.module.named_parameters(), ref_engine.module.named_parameters()):
        torch.testing.assert_close(a.ds_tensor, b.ds_tensor, msg=name)
        if a.ds_persist:
            torch.testing.assert_close(a.data, b.data, msg=name)
    x, t, h = torch.randn(2, 4, 16, 16), torch.tensor([3, 700]), torch.randn(2, 77, 32)
    with torch.no_grad():
        torch.testing.assert_close(ours_engine.module(x, t, h).sample, ref_engine.module(x, t, h).sample)

    # transformers models load the same way
    te = load_pretrained_zero3(CLIPTextModel, pipe_dir, "text_encoder", ds_config=cfg)
    with zero3_init_disabled():
        te_ref = CLIPTextModel.from_pretrained(pipe_dir, subfolder="text_encoder")
    te_engine, *_ = deepspeed.initialize(model=te, config=cfg)
    ids = torch.randint(0, 500, (2, 77))
    with torch.no_grad():
        torch.testing.assert_close(te_engine.module(ids)[0], te_ref(ids)[0])

    # A model that generates keeps its folder's generation settings (a judge answering by
    # generating: its top_k and max_new_tokens), as from_pretrained gives them; built from its
    # config alone it would have none (the control).
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    llama = f"{work}/llama"
    if get_rank() == 0:
        tiny = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
        with zero3_init_disabled():
            lm = LlamaForCausalLM(tiny)
        lm.generation_config = GenerationConfig(max_new_tokens=7, top_k=1, do_sample=True, eos_token_id=3)
        lm.save_pretrained(llama)
    torch.distributed.barrier()
    generating = load_pretrained_zero3(LlamaForCausalLM, llama, ds_config=cfg)
    with zero3_init_disabled():
        from_folder = LlamaForCausalLM.from_pretrained(llama).generation_config
        built = LlamaForCausalLM(LlamaForCausalLM.config_class.from_pretrained(llama)).generation_config
    assert generating.generation_config.max_new_tokens == 7 and generating.generation_config.top_k == 1
    assert generating.generation_config.to_diff_dict() == from_folder.to_diff_dict()
    assert built.max_new_tokens != 7  # the control: the config alone does not carry them

    # Save: consolidated weights, sharded or not, load back with from_pretrained.
    consolidated = ours_engine._zero3_consolidated_16bit_state_dict()
    save_pretrained_zero3(ours_engine, f"{work}/saved")
    save_pretrained_zero3(ours_engine, f"{work}/sharded", max_shard_size="200KB")
    save_pretrained_zero3(te_engine, f"{work}/text_encoder")
    if get_rank() == 0:
        for folder in ("saved", "sharded"):
            loaded = UNet2DConditionModel.from_pretrained(f"{work}/{folder}")
            for k, v in loaded.state_dict().items():
                torch.testing.assert_close(v, consolidated[k], msg=k)
        index = json.load(open(f"{work}/sharded/diffusion_pytorch_model.safetensors.index.json"))
        assert len(set(index["weight_map"].values())) > 1
        with zero3_init_disabled():
            te_loaded = CLIPTextModel.from_pretrained(f"{work}/text_encoder")
        torch.testing.assert_close(te_loaded(ids)[0], te_ref(ids)[0])

        # broken folders for the error messages
        shutil.copytree(f"{pipe_dir}/unet", f"{work}/missing")
        sd = load_file(f"{work}/missing/diffusion_pytorch_model.safetensors")
        del sd["conv_in.weight"]
        save_file(sd, f"{work}/missing/diffusion_pytorch_model.safetensors", metadata={"format": "pt"})
        shutil.copytree(f"{pipe_dir}/unet", f"{work}/shape")
        conf = json.load(open(f"{work}/shape/config.json"))
        conf["block_out_channels"] = [16, 64]
        json.dump(conf, open(f"{work}/shape/config.json", "w"))
    torch.distributed.barrier()
    with pytest.raises(CheckpointError, match="'conv_in.weight' of UNet2DConditionModel is missing"):
        load_pretrained_zero3(UNet2DConditionModel, f"{work}/missing", ds_config=cfg)
    with pytest.raises(CheckpointError, match=r"tensor 'conv_in.weight': checkpoint shape \(32, 4, 3, 3\)"):
        load_pretrained_zero3(UNet2DConditionModel, f"{work}/shape", ds_config=cfg)

    # The partitions' dtype is the one asked for, whatever the config's: DeepSpeed's
    # zero.Init(dtype=...) ignores an explicit dtype on an accelerator without fp16 (its CPU
    # one) and made every partition bf16 (an fp32 SDXL VAE under bf16 training, or an fp32
    # frozen encoder, came out bf16).
    bf16_cfg = {**cfg, "bf16": {"enabled": True}}
    for config, asked in ((cfg, torch.bfloat16), (bf16_cfg, torch.float32), (cfg, None)):
        te = load_pretrained_zero3(
            CLIPTextModel, pipe_dir, "text_encoder", ds_config=config, torch_dtype=asked
        )
        assert {p.ds_tensor.dtype for p in te.parameters()} == {asked or torch.float32}, (
            asked,
            config["bf16"],
        )
    print("OK load-save")


@pytest.mark.multirank
def test_partitioned_load_and_streamed_save(tiny_pipeline, tmp_path):
    outs = run_on_ranks(worker_load_and_save, pipe_dir=tiny_pipeline, work=str(tmp_path))
    assert all("OK load-save" in o for o in outs)


@pytest.mark.unit
def test_skip_torch_init_leaves_tensors_as_they_are_and_restores_the_initialisers():
    from diffusers_zero3.state.pretrained import skip_torch_init

    with skip_torch_init():
        inside = torch.nn.init.kaiming_uniform_(torch.zeros(8, 8))
        layer = torch.nn.Linear(4, 4)  # built without its reset_parameters' writes
    assert torch.count_nonzero(inside) == 0
    outside = torch.nn.init.kaiming_uniform_(torch.zeros(8, 8))  # positive control: restored
    assert torch.count_nonzero(outside) > 0
    assert layer.weight.shape == (4, 4)
