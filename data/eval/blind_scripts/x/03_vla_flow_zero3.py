"""
Flow-matching VLA: a small pretrained VLM backbone + action expert, trained on LeRobot-format
datasets with DeepSpeed ZeRO-3.

    deepspeed --num_gpus 8 train_vla_flow.py --dataset_repo lerobot/droid_100 --output_dir ckpt/vla_flow
"""
import argparse
import copy
import json
import math
import os
import time

import deepspeed
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from lerobot.common.datasets.lerobot_dataset import LeRobotDataset
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoModelForVision2Seq, AutoProcessor

import wandb


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--dataset_repo", type=str, required=True)
    p.add_argument("--vlm", type=str, default="HuggingFaceTB/SmolVLM-500M-Instruct")
    p.add_argument("--output_dir", type=str, required=True)
    p.add_argument("--chunk_size", type=int, default=50)
    p.add_argument("--action_dim", type=int, default=7)
    p.add_argument("--state_dim", type=int, default=8)
    p.add_argument("--expert_width", type=int, default=768)
    p.add_argument("--expert_depth", type=int, default=6)
    p.add_argument("--micro_batch", type=int, default=16)
    p.add_argument("--grad_accum", type=int, default=2)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--warmup_steps", type=int, default=1000)
    p.add_argument("--max_steps", type=int, default=60_000)
    p.add_argument("--ema_decay", type=float, default=0.999)
    p.add_argument("--save_every", type=int, default=5000)
    p.add_argument("--log_every", type=int, default=20)
    p.add_argument("--num_workers", type=int, default=6)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--local_rank", type=int, default=-1)  # filled in by the deepspeed launcher
    p = deepspeed.add_config_arguments(p)
    return p.parse_args()


class ActionExpert(nn.Module):
    """Transformer over noisy action tokens that cross-attends to VLM prefix features."""

    def __init__(self, vlm_dim, width, depth, action_dim, state_dim, chunk):
        super().__init__()
        self.in_proj = nn.Linear(action_dim, width)
        self.state_proj = nn.Linear(state_dim, width)
        self.ctx_proj = nn.Linear(vlm_dim, width)
        self.time_mlp = nn.Sequential(nn.Linear(256, width), nn.SiLU(), nn.Linear(width, width))
        self.pos = nn.Parameter(torch.randn(1, chunk + 1, width) * 0.02)
        layer = nn.TransformerDecoderLayer(width, nhead=width // 64, dim_feedforward=4 * width,
                                           batch_first=True, norm_first=True, activation="gelu")
        self.decoder = nn.TransformerDecoder(layer, depth)
        self.out = nn.Linear(width, action_dim)

    @staticmethod
    def time_embed(t, dim=256):
        half = dim // 2
        f = torch.exp(-math.log(1000.0) * torch.arange(half, device=t.device) / half)
        a = t[:, None] * f[None] * 1000.0
        return torch.cat([a.sin(), a.cos()], -1)

    def forward(self, noisy_actions, t, state, ctx):
        x = torch.cat([self.state_proj(state)[:, None], self.in_proj(noisy_actions)], dim=1) + self.pos
        x = x + self.time_mlp(self.time_embed(t).to(x.dtype))[:, None]
        x = self.decoder(x, self.ctx_proj(ctx))
        return self.out(x[:, 1:])


class FlowVLA(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.vlm = AutoModelForVision2Seq.from_pretrained(args.vlm, torch_dtype=torch.bfloat16)
        hidden = self.vlm.config.text_config.hidden_size
        self.expert = ActionExpert(hidden, args.expert_width, args.expert_depth,
                                   args.action_dim, args.state_dim, args.chunk_size)

    def forward(self, batch):
        out = self.vlm(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       pixel_values=batch["pixel_values"], output_hidden_states=True)
        ctx = out.hidden_states[-1]
        actions = batch["action"]
        b = actions.shape[0]
        # rectified flow: x_t = t * noise + (1 - t) * actions, target velocity = noise - actions
        t = torch.distributions.Beta(1.5, 1.0).sample((b,)).to(actions.device) * 0.999 + 0.001
        noise = torch.randn_like(actions)
        x_t = t[:, None, None] * noise + (1 - t[:, None, None]) * actions
        v = self.expert(x_t.to(ctx.dtype), t, batch["state"].to(ctx.dtype), ctx)
        mask = (~batch["action_is_pad"]).unsqueeze(-1).float()
        return ((v.float() - (noise - actions)) ** 2 * mask).sum() / (mask.sum() * actions.shape[-1])


class Collator:
    def __init__(self, processor, stats):
        self.processor = processor
        self.a_mean, self.a_std = stats["action"]["mean"], stats["action"]["std"]
        self.s_mean, self.s_std = stats["observation.state"]["mean"], stats["observation.state"]["std"]

    def __call__(self, items):
        images = [[it["observation.images.exterior_1_left"]] for it in items]
        prompts = [f"<image>What action should the robot take to {it['task'].lower()}?" for it in items]
        enc = self.processor(text=prompts, images=images, return_tensors="pt", padding=True, do_rescale=False)
        return {
            "input_ids": enc["input_ids"],
            "attention_mask": enc["attention_mask"],
            "pixel_values": enc["pixel_values"].to(torch.bfloat16),
            "state": torch.stack([(it["observation.state"] - self.s_mean) / (self.s_std + 1e-6) for it in items]),
            "action": torch.stack([(it["action"] - self.a_mean) / (self.a_std + 1e-6) for it in items]),
            "action_is_pad": torch.stack([it["action_is_pad"] for it in items]),
        }


@torch.no_grad()
def ema_update(ema_model, model, decay):
    for p_ema, p in zip(ema_model.parameters(), model.parameters()):
        if p.requires_grad:
            p_ema.data.mul_(decay).add_(p.data.to(p_ema.dtype), alpha=1.0 - decay)


def main():
    args = get_args()
    deepspeed.init_distributed()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed + rank)

    ds_config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.grad_accum,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_bucket_size": 5e7,
            "stage3_prefetch_bucket_size": 5e7,
            "stage3_param_persistence_threshold": 1e5,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.95], "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupCosineLR",
                      "params": {"total_num_steps": args.max_steps, "warmup_num_steps": args.warmup_steps,
                                 "warmup_min_ratio": 0.0, "cos_min_ratio": 0.1}},
        "steps_per_print": 1000,
        "wall_clock_breakdown": False,
    }

    delta_t = {"action": [i / 15.0 for i in range(args.chunk_size)]}
    dataset = LeRobotDataset(args.dataset_repo, delta_timestamps=delta_t)
    processor = AutoProcessor.from_pretrained(args.vlm)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.micro_batch, sampler=sampler, num_workers=args.num_workers,
                        collate_fn=Collator(processor, dataset.meta.stats), pin_memory=True, drop_last=True,
                        persistent_workers=True)

    model = FlowVLA(args)
    model.vlm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    engine, _, _, lr_sched = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()
                                                                                  if p.requires_grad],
                                                  config=ds_config)
    ema = copy.deepcopy(engine.module).eval()
    for p in ema.parameters():
        p.requires_grad_(False)

    step = 0
    if os.path.isdir(args.output_dir) and os.path.exists(os.path.join(args.output_dir, "latest")):
        _, client_state = engine.load_checkpoint(args.output_dir)
        step = client_state["step"]
        if rank == 0:
            print(f"resumed at step {step}")

    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        wandb.init(project="vla-flow", config=vars(args), resume="allow")

    engine.train()
    epoch = step * args.grad_accum // len(loader)
    t0 = time.time()
    while step < args.max_steps:
        sampler.set_epoch(epoch)
        for i, batch in enumerate(loader):
            batch = {k: v.to(engine.device, non_blocking=True) for k, v in batch.items()}
            loss = engine(batch)
            engine.backward(loss)
            engine.step()

            if not engine.is_gradient_accumulation_boundary():
                continue
            step += 1
            ema_update(ema, engine.module, args.ema_decay)

            if step % args.log_every == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    wandb.log({"train/loss": l.item(), "train/lr": lr_sched.get_last_lr()[0],
                               "train/step_time": (time.time() - t0) / args.log_every}, step=step)
                t0 = time.time()

            if step % args.save_every == 0 or step == args.max_steps:
                engine.save_checkpoint(args.output_dir, tag=f"step_{step}", client_state={"step": step})
                if rank == 0:
                    torch.save(ema.state_dict(), os.path.join(args.output_dir, f"ema_step_{step}.pt"))
                    with open(os.path.join(args.output_dir, "train_args.json"), "w") as f:
                        json.dump(vars(args), f, indent=2)
                dist.barrier()

            if step >= args.max_steps:
                break
        epoch += 1

    if rank == 0:
        wandb.finish()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
