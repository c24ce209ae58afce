"""PixArt-alpha 512px fine-tuning with FSDP.

Both the trained PixArt transformer and the frozen T5-XXL text encoder are
sharded (T5-XXL alone is ~18 GB in bf16). VAE stays replicated.

    torchrun --nproc_per_node=8 08_pixart_t5_finetune.py --config configs/pixart_ft.json
"""
import argparse
import functools
import json
import os
import time
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from diffusers import AutoencoderKL, DPMSolverMultistepScheduler, DDPMScheduler, PixArtTransformer2DModel
from diffusers.models.attention import BasicTransformerBlock
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision, ShardingStrategy, StateDictType
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from torchvision.utils import make_grid
from transformers import T5EncoderModel, T5Tokenizer
from transformers.models.t5.modeling_t5 import T5Block

from datasets_local import ParquetImageText  # returns (image[-1,1], caption)

DEFAULTS = dict(
    base="PixArt-alpha/PixArt-XL-2-512x512",
    train_index="/data/aesthetic/index.parquet",
    out_dir="runs/pixart512",
    batch_size=16,
    lr=2e-5,
    weight_decay=0.03,
    max_steps=30000,
    warmup=1000,
    max_text_len=120,
    sample_every=500,
    save_every=5000,
    log_every=20,
    sample_prompts=["A small cactus with a happy face in the Sahara desert.",
                    "An astronaut riding a horse, oil painting",
                    "A bowl of ramen, studio photo, 85mm",
                    "Cyberpunk city street at night, rain"],
)


def load_cfg():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    a = ap.parse_args()
    cfg = dict(DEFAULTS)
    if a.config:
        with open(a.config) as f:
            cfg.update(json.load(f))
    return SimpleNamespace(**cfg)


def fsdp_wrap(module, layer_cls, trainable):
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={layer_cls})
    mp = MixedPrecision(param_dtype=torch.bfloat16,
                        reduce_dtype=torch.float32 if trainable else torch.bfloat16,
                        buffer_dtype=torch.bfloat16)
    return FSDP(module, auto_wrap_policy=policy, mixed_precision=mp,
                sharding_strategy=ShardingStrategy.FULL_SHARD,
                device_id=torch.cuda.current_device(), use_orig_params=True, limit_all_gathers=True)


@torch.no_grad()
def encode_text(tokenizer, text_encoder, prompts, max_len, device):
    tok = tokenizer(prompts, max_length=max_len, padding="max_length", truncation=True,
                    add_special_tokens=True, return_tensors="pt").to(device)
    emb = text_encoder(tok.input_ids, attention_mask=tok.attention_mask)[0]
    return emb, tok.attention_mask


@torch.no_grad()
def sample_images(model, vae, tokenizer, text_encoder, prompts, cfg, device, steps=20, guidance=4.5):
    model.eval()
    sched = DPMSolverMultistepScheduler.from_pretrained(cfg.base, subfolder="scheduler")
    sched.set_timesteps(steps, device=device)
    cond, cond_mask = encode_text(tokenizer, text_encoder, prompts, cfg.max_text_len, device)
    unc, unc_mask = encode_text(tokenizer, text_encoder, [""] * len(prompts), cfg.max_text_len, device)
    emb, mask = torch.cat([unc, cond]), torch.cat([unc_mask, cond_mask])
    g = torch.Generator(device=device).manual_seed(42)
    x = torch.randn(len(prompts), 4, 64, 64, generator=g, device=device)
    res = torch.tensor([[512.0, 512.0]] * 2 * len(prompts), device=device)
    ar = torch.tensor([[1.0]] * 2 * len(prompts), device=device)
    for t in sched.timesteps:
        xin = torch.cat([x, x])
        out = model(xin, encoder_hidden_states=emb, encoder_attention_mask=mask,
                    timestep=t.expand(xin.shape[0]),
                    added_cond_kwargs={"resolution": res, "aspect_ratio": ar}).sample
        eps = out[:, :4]
        e_u, e_c = eps.chunk(2)
        x = sched.step(e_u + guidance * (e_c - e_u), t, x).prev_sample
    img = vae.decode(x.to(vae.dtype) / vae.config.scaling_factor).sample
    model.train()
    return ((img.float().clamp(-1, 1) + 1) / 2).cpu()


def main():
    cfg = load_cfg()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(rank)

    writer = SummaryWriter(os.path.join(cfg.out_dir, "tb")) if rank == 0 else None

    tokenizer = T5Tokenizer.from_pretrained(cfg.base, subfolder="tokenizer")
    text_encoder = T5EncoderModel.from_pretrained(cfg.base, subfolder="text_encoder", torch_dtype=torch.bfloat16)
    text_encoder.requires_grad_(False).eval()
    text_encoder = fsdp_wrap(text_encoder, T5Block, trainable=False)

    vae = AutoencoderKL.from_pretrained(cfg.base, subfolder="vae", torch_dtype=torch.bfloat16).to(device)
    vae.requires_grad_(False).eval()

    transformer = PixArtTransformer2DModel.from_pretrained(cfg.base, subfolder="transformer")
    transformer.enable_gradient_checkpointing()
    model = fsdp_wrap(transformer, BasicTransformerBlock, trainable=True)

    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    lr_sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / cfg.warmup))
    noise_sched = DDPMScheduler.from_pretrained(cfg.base, subfolder="scheduler")

    ds = ParquetImageText(cfg.train_index, resolution=512)
    sampler = DistributedSampler(ds, shuffle=True)
    loader = DataLoader(ds, batch_size=cfg.batch_size, sampler=sampler, num_workers=8,
                        pin_memory=True, drop_last=True)

    step, epoch = 0, 0
    t0 = time.time()
    while step < cfg.max_steps:
        sampler.set_epoch(epoch)
        for images, captions in loader:
            images = images.to(device, dtype=torch.bfloat16, non_blocking=True)
            with torch.no_grad():
                latents = vae.encode(images).latent_dist.sample() * vae.config.scaling_factor
                emb, mask = encode_text(tokenizer, text_encoder, list(captions), cfg.max_text_len, device)
            noise = torch.randn_like(latents)
            t = torch.randint(0, noise_sched.config.num_train_timesteps, (latents.shape[0],), device=device)
            noisy = noise_sched.add_noise(latents, noise, t)
            b = latents.shape[0]
            cond = {"resolution": torch.tensor([[512.0, 512.0]] * b, device=device),
                    "aspect_ratio": torch.tensor([[1.0]] * b, device=device)}
            pred = model(noisy, encoder_hidden_states=emb, encoder_attention_mask=mask, timestep=t,
                         added_cond_kwargs=cond).sample[:, :4]
            loss = F.mse_loss(pred.float(), noise.float())
            loss.backward()
            gnorm = model.clip_grad_norm_(1.0)
            optimizer.step()
            lr_sched.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            if step % cfg.log_every == 0:
                stats = torch.stack([loss.detach(), gnorm.detach().float()])
                dist.all_reduce(stats, op=dist.ReduceOp.AVG)
                if rank == 0:
                    writer.add_scalar("train/loss", stats[0].item(), step)
                    writer.add_scalar("train/grad_norm", stats[1].item(), step)
                    writer.add_scalar("train/lr", lr_sched.get_last_lr()[0], step)
                    print(f"step {step} loss {stats[0].item():.4f} ({(time.time() - t0) / cfg.log_every:.2f}s/it)",
                          flush=True)
                t0 = time.time()

            if rank == 0 and step % cfg.sample_every == 0:
                imgs = sample_images(model, vae, tokenizer, text_encoder, cfg.sample_prompts, cfg, device)
                writer.add_image("samples", make_grid(imgs, nrow=2), step)

            if step % cfg.save_every == 0:
                with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                          FullStateDictConfig(offload_to_cpu=True, rank0_only=True)):
                    sd = model.state_dict()
                if rank == 0:
                    os.makedirs(cfg.out_dir, exist_ok=True)
                    torch.save(sd, os.path.join(cfg.out_dir, f"transformer_{step:06d}.pt"))
                dist.barrier()

            if step >= cfg.max_steps:
                break
        epoch += 1

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
