"""
ControlNet-lite: a small trainable control encoder that feeds zero-initialised
residuals into a frozen SD-1.5 UNet (same injection points as ControlNet).
Conditioning: canny / depth / pose maps stored next to the images.

  torchrun --nproc_per_node=8 train_ctrl_lite.py --data_root /data/laion_canny --output_dir out/canny_lite
"""
import argparse
import json
import os
import random
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import wandb
from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms
from transformers import CLIPTextModel, CLIPTokenizer

SD = "runwayml/stable-diffusion-v1-5"
DOWN_CH = [320, 320, 320, 320, 640, 640, 640, 1280, 1280, 1280, 1280, 1280]
DOWN_STRIDE = [1, 1, 1, 2, 1, 1, 2, 1, 1, 2, 1, 1]


def zero_conv(c):
    conv = nn.Conv2d(c, c, 1)
    nn.init.zeros_(conv.weight)
    nn.init.zeros_(conv.bias)
    return conv


class ControlLite(nn.Module):
    def __init__(self, cond_ch=3):
        super().__init__()
        # 512 -> 64, like ControlNet's hint block
        self.hint = nn.Sequential(
            nn.Conv2d(cond_ch, 16, 3, padding=1), nn.SiLU(),
            nn.Conv2d(16, 32, 3, padding=1, stride=2), nn.SiLU(),
            nn.Conv2d(32, 96, 3, padding=1, stride=2), nn.SiLU(),
            nn.Conv2d(96, 256, 3, padding=1, stride=2), nn.SiLU(),
            nn.Conv2d(256, 320, 3, padding=1),
        )
        self.stages = nn.ModuleList()
        self.zeros = nn.ModuleList()
        cin = 320
        for c, s in zip(DOWN_CH, DOWN_STRIDE):
            self.stages.append(nn.Sequential(nn.Conv2d(cin, c, 3, stride=s, padding=1), nn.GroupNorm(32, c), nn.SiLU(),
                                             nn.Conv2d(c, c, 3, padding=1)))
            self.zeros.append(zero_conv(c))
            cin = c
        self.mid = nn.Sequential(nn.Conv2d(1280, 1280, 3, padding=1), nn.SiLU())
        self.mid_zero = zero_conv(1280)

    def forward(self, cond, scale=1.0):
        h = self.hint(cond)
        outs = []
        for stage, zc in zip(self.stages, self.zeros):
            h = stage(h)
            outs.append(zc(h) * scale)
        mid = self.mid_zero(self.mid(h)) * scale
        return outs, mid


class PairDataset(Dataset):
    """metadata.jsonl lines: {"image": "...", "cond": "...", "text": "..."}"""

    def __init__(self, root, tokenizer, res=512, drop_text=0.05):
        with open(os.path.join(root, "metadata.jsonl")) as f:
            self.rows = [json.loads(l) for l in f]
        self.root, self.tok, self.res, self.drop_text = root, tokenizer, res, drop_text
        self.img_tf = transforms.Compose([transforms.Resize(res), transforms.CenterCrop(res), transforms.ToTensor(),
                                          transforms.Normalize([0.5], [0.5])])
        self.cond_tf = transforms.Compose([transforms.Resize(res), transforms.CenterCrop(res), transforms.ToTensor()])

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        img = self.img_tf(Image.open(os.path.join(self.root, r["image"])).convert("RGB"))
        cond = self.cond_tf(Image.open(os.path.join(self.root, r["cond"])).convert("RGB"))
        text = "" if random.random() < self.drop_text else r["text"]
        ids = self.tok(text, padding="max_length", max_length=self.tok.model_max_length, truncation=True,
                       return_tensors="pt").input_ids[0]
        return img, cond, ids


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--data_root", required=True)
    p.add_argument("--output_dir", default="out/ctrl_lite")
    p.add_argument("--train_batch_size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--max_steps", type=int, default=50_000)
    p.add_argument("--checkpointing_steps", type=int, default=2500)
    p.add_argument("--num_workers", type=int, default=6)
    p.add_argument("--wandb_project", default="controlnet-lite")
    p.add_argument("--run_name", default=None)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed + rank)
    random.seed(args.seed + rank)

    wandb.init(project=args.wandb_project, name=args.run_name, config=vars(args))

    tokenizer = CLIPTokenizer.from_pretrained(SD, subfolder="tokenizer")
    text_encoder = CLIPTextModel.from_pretrained(SD, subfolder="text_encoder").to(device, torch.float16)
    vae = AutoencoderKL.from_pretrained(SD, subfolder="vae").to(device, torch.float16)
    unet = UNet2DConditionModel.from_pretrained(SD, subfolder="unet").to(device, torch.float16)
    noise_sched = DDPMScheduler.from_pretrained(SD, subfolder="scheduler")
    for m in (text_encoder, vae, unet):
        m.requires_grad_(False)
        m.eval()

    ctrl = ControlLite().to(device)
    ctrl = DDP(ctrl, device_ids=[local_rank])
    opt = torch.optim.AdamW(ctrl.parameters(), lr=args.lr)
    scaler = torch.cuda.amp.GradScaler()

    ds = PairDataset(args.data_root, tokenizer)
    sampler = DistributedSampler(ds, shuffle=True, seed=args.seed, drop_last=True)
    dl = DataLoader(ds, batch_size=args.train_batch_size, sampler=sampler, num_workers=args.num_workers,
                    pin_memory=True, drop_last=True)
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        print(f"{len(ds)} pairs, {sum(p.numel() for p in ctrl.parameters()) / 1e6:.1f}M trainable", flush=True)

    alphas = noise_sched.alphas_cumprod.to(device)
    step, epoch = 0, 0
    t0 = time.time()
    while step < args.max_steps:
        sampler.set_epoch(epoch)
        for img, cond, ids in dl:
            img = img.to(device, torch.float16, non_blocking=True)
            cond = cond.to(device, non_blocking=True)
            ids = ids.to(device)
            with torch.no_grad():
                lat = vae.encode(img).latent_dist.sample() * vae.config.scaling_factor
                txt = text_encoder(ids)[0]
            noise = torch.randn_like(lat)
            t = torch.randint(0, noise_sched.config.num_train_timesteps, (lat.size(0),), device=device)
            noisy = noise_sched.add_noise(lat, noise, t)

            with torch.autocast("cuda", dtype=torch.float16):
                down_res, mid_res = ctrl(cond)
                pred = unet(noisy, t, encoder_hidden_states=txt,
                            down_block_additional_residuals=[d.to(torch.float16) for d in down_res],
                            mid_block_additional_residual=mid_res.to(torch.float16)).sample
            loss = F.mse_loss(pred.float(), noise.float())

            opt.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            gn = torch.nn.utils.clip_grad_norm_(ctrl.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            step += 1

            if step % 50 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    wandb.log({"loss": l.item(), "grad_norm": gn.item(), "scale": scaler.get_scale(),
                               "it_per_s": 50 / (time.time() - t0)}, step=step)
                    t0 = time.time()

            if step % args.checkpointing_steps == 0:
                if rank == 0:
                    path = os.path.join(args.output_dir, f"ctrl_{step:06d}.pt")
                    torch.save({"ctrl": ctrl.module.state_dict(), "opt": opt.state_dict(),
                                "scaler": scaler.state_dict(), "step": step}, path)
                    # quick visual check on a fixed batch
                    with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
                        vis = vae.decode(lat[:4] / vae.config.scaling_factor).sample
                    wandb.log({"inputs": [wandb.Image(v.float().clamp(-1, 1) * 0.5 + 0.5) for v in vis],
                               "cond": [wandb.Image(c) for c in cond[:4]]}, step=step)
                dist.barrier()
            if step >= args.max_steps:
                break
        epoch += 1

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
