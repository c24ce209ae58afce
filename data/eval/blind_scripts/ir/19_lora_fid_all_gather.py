"""Food-photography LoRA on SD 1.5 with an FID check against the held-out real photos.

torchrun --nproc_per_node 8 19_lora_fid_all_gather.py --train_dir /data/food/train --fid_dir /data/food/holdout
"""
import argparse
import glob
import os
import random

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from PIL import Image
from pytorch_fid.fid_score import calculate_frechet_distance
from pytorch_fid.inception import InceptionV3
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms
import wandb

from diffusers import AutoencoderKL, DDIMScheduler, DDPMScheduler, StableDiffusionPipeline, UNet2DConditionModel
from diffusers.optimization import get_scheduler
from peft import LoraConfig, get_peft_model_state_dict
from transformers import CLIPTextModel, CLIPTokenizer


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="runwayml/stable-diffusion-v1-5")
    ap.add_argument("--train_dir", required=True, help="images + .txt captions")
    ap.add_argument("--fid_dir", required=True, help="held-out images + .txt captions")
    ap.add_argument("--out", default="runs/food-lora")
    ap.add_argument("--batch_size", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--max_steps", type=int, default=8000)
    ap.add_argument("--lora_r", type=int, default=16)
    ap.add_argument("--p_uncond", type=float, default=0.1)
    ap.add_argument("--fid_every", type=int, default=2000)
    ap.add_argument("--gen_batch", type=int, default=8)
    ap.add_argument("--guidance", type=float, default=5.0)
    return ap.parse_args()


def list_pairs(root):
    imgs = sorted(glob.glob(os.path.join(root, "*.jpg")) + glob.glob(os.path.join(root, "*.png")))
    pairs = []
    for im in imgs:
        txt = os.path.splitext(im)[0] + ".txt"
        with open(txt) as f:
            pairs.append((im, f.read().strip()))
    return pairs


class PairDataset(Dataset):
    def __init__(self, pairs, tokenizer, p_uncond, size=512):
        self.pairs, self.tok, self.p_uncond = pairs, tokenizer, p_uncond
        self.tf = transforms.Compose([transforms.Resize(size), transforms.RandomCrop(size),
                                      transforms.RandomHorizontalFlip(), transforms.ToTensor(),
                                      transforms.Normalize([0.5], [0.5])])

    def __len__(self):
        return len(self.pairs)

    def __getitem__(self, i):
        path, cap = self.pairs[i]
        if random.random() < self.p_uncond:
            cap = ""
        ids = self.tok(cap, max_length=77, padding="max_length", truncation=True, return_tensors="pt").input_ids[0]
        return self.tf(Image.open(path).convert("RGB")), ids


@torch.no_grad()
def inception_feats(inception, images):
    # images: float tensor in [0, 1], (B, 3, H, W)
    x = F.interpolate(images, size=(299, 299), mode="bilinear", align_corners=False)
    return inception(x)[0].flatten(1)


@torch.no_grad()
def real_stats(pairs, inception, device, rank, world):
    tf = transforms.Compose([transforms.Resize(512), transforms.CenterCrop(512), transforms.ToTensor()])
    feats = []
    mine = pairs[rank::world]
    for i in range(0, len(mine), 32):
        x = torch.stack([tf(Image.open(p).convert("RGB")) for p, _ in mine[i:i + 32]]).to(device)
        feats.append(inception_feats(inception, x))
    feats = torch.cat(feats)
    gathered = [torch.zeros_like(feats) for _ in range(world)]
    dist.all_gather(gathered, feats)
    allf = torch.cat(gathered).double().cpu().numpy()
    return allf.mean(0), np.cov(allf, rowvar=False)


@torch.no_grad()
def fid_of_generated(pipe, inception, pairs, ref, args, device, rank, world):
    mine = pairs[rank::world]
    g = torch.Generator(device).manual_seed(10_000 + rank)
    feats = []
    for i in range(0, len(mine), args.gen_batch):
        prompts = [c for _, c in mine[i:i + args.gen_batch]]
        with torch.autocast("cuda", dtype=torch.float16):
            imgs = pipe(prompts, num_inference_steps=25, guidance_scale=args.guidance, generator=g,
                        output_type="pt").images
        feats.append(inception_feats(inception, imgs.float()))
    feats = torch.cat(feats)
    gathered = [torch.zeros_like(feats) for _ in range(world)]
    dist.all_gather(gathered, feats)
    allf = torch.cat(gathered).double().cpu().numpy()
    return calculate_frechet_distance(allf.mean(0), np.cov(allf, rowvar=False), *ref)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(rank)
    torch.manual_seed(rank)
    if rank == 0:
        wandb.init(project="food-lora", config=vars(args))

    tok = CLIPTokenizer.from_pretrained(args.base, subfolder="tokenizer")
    te = CLIPTextModel.from_pretrained(args.base, subfolder="text_encoder", torch_dtype=torch.float16).to(device)
    vae = AutoencoderKL.from_pretrained(args.base, subfolder="vae", torch_dtype=torch.float16).to(device)
    unet = UNet2DConditionModel.from_pretrained(args.base, subfolder="unet", torch_dtype=torch.float16).to(device)
    noise_sched = DDPMScheduler.from_pretrained(args.base, subfolder="scheduler")
    for m in (te, vae, unet):
        m.requires_grad_(False)
    unet.add_adapter(LoraConfig(r=args.lora_r, lora_alpha=args.lora_r, init_lora_weights="gaussian",
                                target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    lora = [p for p in unet.parameters() if p.requires_grad]
    for p in lora:
        p.data = p.data.float()
    model = DDP(unet, device_ids=[local_rank])

    train_pairs, fid_pairs = list_pairs(args.train_dir), list_pairs(args.fid_dir)
    ds = PairDataset(train_pairs, tok, args.p_uncond)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    dl = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, num_workers=6, drop_last=True, pin_memory=True)

    opt = torch.optim.AdamW(lora, lr=args.lr, weight_decay=1e-2)
    lr_sched = get_scheduler("cosine", opt, num_warmup_steps=200, num_training_steps=args.max_steps)
    scaler = torch.cuda.amp.GradScaler()

    inception = InceptionV3([InceptionV3.BLOCK_INDEX_BY_DIM[2048]]).to(device).eval()
    ref = real_stats(fid_pairs, inception, device, rank, world)
    pipe = StableDiffusionPipeline(vae=vae, text_encoder=te, tokenizer=tok, unet=unet,
                                   scheduler=DDIMScheduler.from_config(noise_sched.config), safety_checker=None,
                                   feature_extractor=None, requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)

    step, epoch = 0, 0
    while step < args.max_steps:
        sampler.set_epoch(epoch)
        model.train()
        for x, ids in dl:
            x, ids = x.to(device, torch.float16), ids.to(device)
            with torch.no_grad():
                z = vae.encode(x).latent_dist.sample() * vae.config.scaling_factor
                c = te(ids)[0]
            noise = torch.randn_like(z)
            t = torch.randint(0, noise_sched.config.num_train_timesteps, (z.shape[0],), device=device)
            with torch.autocast("cuda", dtype=torch.float16):
                pred = model(noise_sched.add_noise(z, noise, t), t, c).sample
            loss = F.mse_loss(pred.float(), noise.float())
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(lora, 1.0)
            scaler.step(opt)
            scaler.update()
            lr_sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1

            if step % 50 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    wandb.log({"loss": l.item(), "lr": lr_sched.get_last_lr()[0]}, step=step)

            if step % args.fid_every == 0 or step == args.max_steps:
                model.eval()
                fid = fid_of_generated(pipe, inception, fid_pairs, ref, args, device, rank, world)
                model.train()
                if rank == 0:
                    wandb.log({"fid": fid}, step=step)
                    print(f"step {step}: FID {fid:.2f} ({len(fid_pairs)} images)", flush=True)
                    os.makedirs(args.out, exist_ok=True)
                    torch.save(get_peft_model_state_dict(unet), os.path.join(args.out, f"lora_{step}.pt"))
                dist.barrier()
            if step >= args.max_steps:
                break
        epoch += 1

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
