"""SD 2.1 UNet full fine-tune with DeepSpeed ZeRO-3 (optimizer offload) and an EMA on rank 0.

deepspeed --num_nodes 1 --num_gpus 8 17_zero3_ema_gathered.py --train_jsonl data/train.jsonl --out ckpt/z3
"""
import argparse
import copy
import json
import os
import random

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms

from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
from transformers import CLIPTextModel, CLIPTokenizer


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="stabilityai/stable-diffusion-2-1")
    parser.add_argument("--train_jsonl", required=True)
    parser.add_argument("--out", default="ckpt/z3")
    parser.add_argument("--micro_bs", type=int, default=4)
    parser.add_argument("--grad_accum", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--ema_decay", type=float, default=0.999)
    parser.add_argument("--ema_every", type=int, default=10, help="optimizer steps between EMA updates")
    parser.add_argument("--p_uncond", type=float, default=0.1)
    parser.add_argument("--save_every", type=int, default=2000)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--local_rank", type=int, default=-1)
    return parser.parse_args()


class JsonlDataset(Dataset):
    def __init__(self, path, size=768):
        with open(path) as f:
            self.rows = [json.loads(l) for l in f]
        self.tf = transforms.Compose([transforms.Resize(size), transforms.RandomCrop(size), transforms.ToTensor(),
                                      transforms.Normalize([0.5], [0.5])])

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        return self.tf(Image.open(r["path"]).convert("RGB")), r["caption"]


def build_ds_config(args, world_size):
    return {
        # written out explicitly so the log shows the global batch for this world size
        "train_batch_size": args.micro_bs * args.grad_accum * world_size,
        "train_micro_batch_size_per_gpu": args.micro_bs,
        "gradient_accumulation_steps": args.grad_accum,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "overlap_comm": True,
            "contiguous_gradients": True,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "weight_decay": 1e-2}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": args.lr,
                                                       "warmup_num_steps": 1000}},
        "steps_per_print": 100,
    }


@torch.no_grad()
def ema_update(ema_params, engine, decay, rank):
    # parameters are partitioned under ZeRO-3: gather them (collective, all ranks) before reading
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
        if rank == 0:
            for e, p in zip(ema_params, params):
                e.mul_(decay).add_(p.data.float().cpu(), alpha=1 - decay)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    deepspeed.init_distributed()
    device = torch.device("cuda", local_rank)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    random.seed(rank)
    torch.manual_seed(rank)

    tokenizer = CLIPTokenizer.from_pretrained(args.model, subfolder="tokenizer")
    text_encoder = CLIPTextModel.from_pretrained(args.model, subfolder="text_encoder",
                                                 torch_dtype=torch.bfloat16).to(device).requires_grad_(False)
    vae = AutoencoderKL.from_pretrained(args.model, subfolder="vae", torch_dtype=torch.bfloat16).to(device)
    vae.requires_grad_(False)
    noise_scheduler = DDPMScheduler.from_pretrained(args.model, subfolder="scheduler")

    unet = UNet2DConditionModel.from_pretrained(args.model, subfolder="unet")
    unet.enable_gradient_checkpointing()
    # EMA starts from the pretrained weights, which every rank loaded in full before partitioning
    ema_params = [p.detach().float().cpu().clone() for p in unet.parameters()] if rank == 0 else None
    unet_config = unet.config

    ds = JsonlDataset(args.train_jsonl)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    dl = DataLoader(ds, batch_size=args.micro_bs, sampler=sampler, num_workers=6, pin_memory=True, drop_last=True)

    engine, _, _, _ = deepspeed.initialize(model=unet, model_parameters=unet.parameters(),
                                           config=build_ds_config(args, world_size))

    step, start_epoch = 0, 0
    if args.resume:
        _, client = engine.load_checkpoint(args.out)
        if client is not None:
            step, start_epoch = client["step"], client["epoch"]
            if rank == 0:
                ema_params = torch.load(os.path.join(args.out, "ema_params.pt"), map_location="cpu")

    with torch.no_grad():
        null_ids = tokenizer([""], padding="max_length", max_length=77, return_tensors="pt").input_ids
        null_emb = text_encoder(null_ids.to(device))[0]

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        engine.train()
        for micro, (pixels, captions) in enumerate(dl):
            pixels = pixels.to(device, torch.bfloat16, non_blocking=True)
            with torch.no_grad():
                lat = vae.encode(pixels).latent_dist.sample() * vae.config.scaling_factor
                ids = tokenizer(list(captions), padding="max_length", max_length=77, truncation=True,
                                return_tensors="pt").input_ids.to(device)
                cond = text_encoder(ids)[0]
                cond = torch.where(torch.rand(cond.shape[0], 1, 1, device=device) < args.p_uncond, null_emb, cond)
            noise = torch.randn_like(lat)
            t = torch.randint(0, noise_scheduler.config.num_train_timesteps, (lat.shape[0],), device=device)
            target = noise_scheduler.get_velocity(lat, noise, t)
            pred = engine(noise_scheduler.add_noise(lat, noise, t), t, cond).sample
            loss = F.mse_loss(pred.float(), target.float())
            engine.backward(loss)
            engine.step()

            if (micro + 1) % args.grad_accum != 0:
                continue
            step += 1
            if step % args.ema_every == 0:
                ema_update(ema_params, engine, args.ema_decay ** args.ema_every, rank)

            if step % 100 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} step {step} loss {l.item():.4f}", flush=True)

            if step % args.save_every == 0:
                engine.save_checkpoint(args.out, tag=f"step{step}", client_state={"step": step, "epoch": epoch})
                if rank == 0:
                    torch.save(ema_params, os.path.join(args.out, "ema_params.pt"))
                dist.barrier()

    engine.save_16bit_model(os.path.join(args.out, "final"), "diffusion_pytorch_model.bin")
    if rank == 0:
        ema_unet = UNet2DConditionModel.from_config(unet_config)
        for p, e in zip(ema_unet.parameters(), ema_params):
            p.data.copy_(e)
        ema_unet.save_pretrained(os.path.join(args.out, "unet_ema"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
