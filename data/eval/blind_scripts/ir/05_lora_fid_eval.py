"""LoRA fine-tuning of SD 1.5 on COCO-style captions with periodic zero-shot FID.

torchrun --nproc_per_node 8 05_lora_fid_eval.py \
    --train_list data/coco_train.jsonl --eval_prompts data/coco_val_2k.txt \
    --fid_ref_stats data/coco_val_512_inception.npz
"""
import argparse
import json
import logging
import math
import os

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
from torch.utils.tensorboard import SummaryWriter
from torchvision import transforms

from diffusers import AutoencoderKL, DDPMScheduler, DPMSolverMultistepScheduler, StableDiffusionPipeline, UNet2DConditionModel
from diffusers.optimization import get_scheduler
from diffusers.utils import convert_state_dict_to_diffusers
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict
from transformers import CLIPTextModel, CLIPTokenizer

logger = logging.getLogger("lora_fid")


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--base", default="runwayml/stable-diffusion-v1-5")
    p.add_argument("--train_list", required=True)
    p.add_argument("--eval_prompts", required=True)
    p.add_argument("--fid_ref_stats", required=True)
    p.add_argument("--out", default="runs/coco-lora")
    p.add_argument("--bs", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--steps", type=int, default=30000)
    p.add_argument("--lora_rank", type=int, default=32)
    p.add_argument("--p_uncond", type=float, default=0.1)
    p.add_argument("--eval_every", type=int, default=5000)
    p.add_argument("--eval_bs", type=int, default=16)
    p.add_argument("--cfg_scale", type=float, default=3.0)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


class JsonlCaptions(Dataset):
    def __init__(self, path, tokenizer, res=512):
        with open(path) as f:
            self.rows = [json.loads(l) for l in f]
        self.tok = tokenizer
        self.tf = transforms.Compose([
            transforms.Resize(res), transforms.CenterCrop(res),
            transforms.ToTensor(), transforms.Normalize([0.5], [0.5]),
        ])

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        img = self.tf(Image.open(r["image"]).convert("RGB"))
        ids = self.tok(r["caption"], padding="max_length", truncation=True,
                       max_length=self.tok.model_max_length, return_tensors="pt").input_ids[0]
        return img, ids


@torch.no_grad()
def evaluate_fid(pipe, inception, prompts, ref, args, device, rank, world_size):
    my_prompts = prompts[rank::world_size]
    gen = torch.Generator(device).manual_seed(args.seed + rank)
    feats = []
    for i in range(0, len(my_prompts), args.eval_bs):
        batch = my_prompts[i:i + args.eval_bs]
        images = pipe(batch, num_inference_steps=20, guidance_scale=args.cfg_scale,
                      generator=gen, output_type="pt").images  # (B,3,H,W) in [0,1]
        images = F.interpolate(images.float(), size=(299, 299), mode="bilinear", align_corners=False)
        feats.append(inception(images)[0].squeeze(-1).squeeze(-1).double())
    feats = torch.cat(feats).cpu().numpy()
    mu, sigma = feats.mean(axis=0), np.cov(feats, rowvar=False)
    return calculate_frechet_distance(mu, sigma, ref["mu"], ref["sigma"])


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    torch.manual_seed(args.seed + rank)
    writer = SummaryWriter(os.path.join(args.out, "tb")) if rank == 0 else None

    tok = CLIPTokenizer.from_pretrained(args.base, subfolder="tokenizer")
    text_encoder = CLIPTextModel.from_pretrained(args.base, subfolder="text_encoder", torch_dtype=torch.float16).to(device)
    vae = AutoencoderKL.from_pretrained(args.base, subfolder="vae", torch_dtype=torch.float16).to(device)
    unet = UNet2DConditionModel.from_pretrained(args.base, subfolder="unet", torch_dtype=torch.float16).to(device)
    train_sched = DDPMScheduler.from_pretrained(args.base, subfolder="scheduler")
    for m in (text_encoder, vae, unet):
        m.requires_grad_(False)
    unet.add_adapter(LoraConfig(r=args.lora_rank, lora_alpha=args.lora_rank, init_lora_weights="gaussian",
                                target_modules=["to_q", "to_k", "to_v", "to_out.0", "proj_in", "proj_out"]))
    params = [p for p in unet.parameters() if p.requires_grad]
    for p in params:
        p.data = p.data.float()
    ddp_unet = DDP(unet, device_ids=[local_rank])

    ds = JsonlCaptions(args.train_list, tok)
    sampler = DistributedSampler(ds, shuffle=True, seed=args.seed)
    dl = DataLoader(ds, batch_size=args.bs, sampler=sampler, num_workers=8, pin_memory=True, drop_last=True)

    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    sched = get_scheduler("constant_with_warmup", opt, num_warmup_steps=500)
    scaler = torch.cuda.amp.GradScaler()

    with torch.no_grad():
        empty = tok([""], padding="max_length", max_length=tok.model_max_length, return_tensors="pt").input_ids
        null_cond = text_encoder(empty.to(device))[0]

    with open(args.eval_prompts) as f:
        eval_prompts = [l.strip() for l in f if l.strip()]
    ref = np.load(args.fid_ref_stats)
    inception = InceptionV3([InceptionV3.BLOCK_INDEX_BY_DIM[2048]]).to(device).eval()

    step, epoch = 0, 0
    while step < args.steps:
        sampler.set_epoch(epoch)
        ddp_unet.train()
        for img, ids in dl:
            img, ids = img.to(device, torch.float16, non_blocking=True), ids.to(device, non_blocking=True)
            with torch.no_grad():
                lat = vae.encode(img).latent_dist.sample() * vae.config.scaling_factor
                cond = text_encoder(ids)[0]
                keep = (torch.rand(cond.size(0), device=device) >= args.p_uncond).view(-1, 1, 1)
                cond = torch.where(keep, cond, null_cond)
            noise = torch.randn_like(lat)
            t = torch.randint(0, train_sched.config.num_train_timesteps, (lat.size(0),), device=device)
            noisy = train_sched.add_noise(lat, noise, t)
            with torch.autocast("cuda", dtype=torch.float16):
                pred = ddp_unet(noisy, t, cond).sample
            loss = F.mse_loss(pred.float(), noise.float())
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            scaler.step(opt)
            scaler.update()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1

            if step % 100 == 0:
                l = loss.detach()
                dist.all_reduce(l)
                if rank == 0:
                    writer.add_scalar("train/loss", l.item() / world_size, step)
                    writer.add_scalar("train/lr", sched.get_last_lr()[0], step)

            if step % args.eval_every == 0 or step == args.steps:
                ddp_unet.eval()
                pipe = StableDiffusionPipeline(vae=vae, text_encoder=text_encoder, tokenizer=tok, unet=unet,
                                               scheduler=DPMSolverMultistepScheduler.from_config(train_sched.config),
                                               safety_checker=None, feature_extractor=None,
                                               requires_safety_checker=False)
                pipe.set_progress_bar_config(disable=True)
                with torch.autocast("cuda", dtype=torch.float16):
                    fid = evaluate_fid(pipe, inception, eval_prompts, ref, args, device, rank, world_size)
                if rank == 0:
                    logger.info("step %d  FID %.2f", step, fid)
                    writer.add_scalar("eval/fid", fid, step)
                    save_dir = os.path.join(args.out, f"step_{step}")
                    lora_sd = convert_state_dict_to_diffusers(get_peft_model_state_dict(unet))
                    StableDiffusionPipeline.save_lora_weights(save_dir, unet_lora_layers=lora_sd)
                del pipe
                dist.barrier()
                ddp_unet.train()

            if step >= args.steps:
                break
        epoch += 1

    if rank == 0:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
