"""Single-node multi-GPU LoRA fine-tune of SD 1.5, launched with torch.multiprocessing.spawn.

    python 08_spawn_lora_clipscore.py --gpus 4 --data data/pokemon.jsonl --out runs/pokemon-lora

Every CLIP-score eval generates images for a held-out prompt list spread over the GPUs.
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms

from diffusers import AutoencoderKL, DDIMScheduler, DDPMScheduler, StableDiffusionPipeline, UNet2DConditionModel
from peft import LoraConfig, get_peft_model_state_dict, set_peft_model_state_dict
from transformers import CLIPModel, CLIPProcessor, CLIPTextModel, CLIPTokenizer


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    p.add_argument("--base", default="runwayml/stable-diffusion-v1-5")
    p.add_argument("--data", required=True)
    p.add_argument("--eval_prompts", default="data/eval_prompts.txt")
    p.add_argument("--out", default="runs/lora")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--r", type=int, default=8)
    p.add_argument("--uncond", type=float, default=0.1)
    p.add_argument("--ema", type=float, default=0.995)
    p.add_argument("--eval_every", type=int, default=5, help="epochs")
    p.add_argument("--resume", default=None)
    p.add_argument("--port", default="29511")
    return p.parse_args()


class JsonlImages(Dataset):
    def __init__(self, path, tokenizer):
        with open(path) as f:
            self.rows = [json.loads(x) for x in f]
        self.tok = tokenizer
        self.tf = transforms.Compose([transforms.Resize(512), transforms.CenterCrop(512),
                                      transforms.RandomHorizontalFlip(), transforms.ToTensor(),
                                      transforms.Normalize([0.5], [0.5])])

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        ids = self.tok(r["text"], max_length=77, padding="max_length", truncation=True,
                       return_tensors="pt").input_ids[0]
        return self.tf(Image.open(r["image"]).convert("RGB")), ids


@torch.no_grad()
def clip_score(rank, world_size, pipe, clip, proc, prompts, device):
    mine = prompts[rank::world_size]  # shards may differ by one prompt
    total = torch.zeros(2, device=device, dtype=torch.float64)
    g = torch.Generator(device).manual_seed(1234 + rank)
    for i in range(0, len(mine), 8):
        chunk = mine[i:i + 8]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            images = pipe(chunk, num_inference_steps=25, guidance_scale=7.0, generator=g).images
        batch = proc(text=chunk, images=images, return_tensors="pt", padding=True, truncation=True).to(device)
        out = clip(**batch)
        sim = F.cosine_similarity(out.image_embeds, out.text_embeds, dim=-1)
        total[0] += (100.0 * sim).clamp(min=0).sum().double()
        total[1] += len(chunk)
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return (total[0] / total[1]).item()


def worker(rank, world_size, args):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", args.port)
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world_size)
    device = torch.device("cuda", rank)
    torch.manual_seed(rank)

    tok = CLIPTokenizer.from_pretrained(args.base, subfolder="tokenizer")
    te = CLIPTextModel.from_pretrained(args.base, subfolder="text_encoder", torch_dtype=torch.bfloat16).to(device)
    vae = AutoencoderKL.from_pretrained(args.base, subfolder="vae", torch_dtype=torch.bfloat16).to(device)
    unet = UNet2DConditionModel.from_pretrained(args.base, subfolder="unet", torch_dtype=torch.bfloat16).to(device)
    noise_sched = DDPMScheduler.from_pretrained(args.base, subfolder="scheduler")
    for m in (te, vae, unet):
        m.requires_grad_(False)
    unet.add_adapter(LoraConfig(r=args.r, lora_alpha=args.r, target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    lora = [p for p in unet.parameters() if p.requires_grad]
    for p in lora:
        p.data = p.data.float()
    opt = torch.optim.AdamW(lora, lr=args.lr, weight_decay=1e-4)
    ck = torch.load(args.resume, map_location=device) if args.resume else None
    if ck is not None:
        set_peft_model_state_dict(unet, ck["lora"])
        opt.load_state_dict(ck["opt"])
    # DDP broadcasts rank 0's weights, so the LoRA init seed does not need to match across ranks
    model = DDP(unet, device_ids=[rank])
    ema = [p.detach().clone() for p in lora]
    if ck is not None:
        for e, v in zip(ema, ck["ema"]):
            e.copy_(v)
    start_epoch = ck["epoch"] + 1 if ck is not None else 0

    ds = JsonlImages(args.data, tok)
    sampler = DistributedSampler(ds, num_replicas=world_size, rank=rank, shuffle=True, drop_last=True)
    dl = DataLoader(ds, batch_size=args.batch, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)

    with torch.no_grad():
        null = te(tok([""], max_length=77, padding="max_length", return_tensors="pt").input_ids.to(device))[0]

    clip = CLIPModel.from_pretrained("openai/clip-vit-base-patch16").to(device).eval()
    proc = CLIPProcessor.from_pretrained("openai/clip-vit-base-patch16")
    with open(args.eval_prompts) as f:
        eval_prompts = [l.strip() for l in f if l.strip()]

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0, loss_sum, n = time.time(), torch.zeros((), device=device), 0
        for x, ids in dl:
            x, ids = x.to(device, torch.bfloat16), ids.to(device)
            with torch.no_grad():
                z = vae.encode(x).latent_dist.sample() * vae.config.scaling_factor
                c = te(ids)[0]
            c = torch.where((torch.rand(c.shape[0], 1, 1, device=device) < args.uncond), null, c)
            noise = torch.randn_like(z)
            t = torch.randint(0, 1000, (z.shape[0],), device=device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = model(noise_sched.add_noise(z, noise, t), t, c).sample
            loss = F.mse_loss(pred.float(), noise.float())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(lora, 1.0)
            opt.step()
            with torch.no_grad():
                for e, p in zip(ema, lora):
                    e.lerp_(p, 1 - args.ema)
            loss_sum += loss.detach()
            n += 1

        dist.all_reduce(loss_sum)
        if rank == 0:
            print(f"epoch {epoch} loss {loss_sum.item() / (n * world_size):.4f} ({time.time() - t0:.0f}s)", flush=True)

        if (epoch + 1) % args.eval_every == 0:
            backup = [p.detach().clone() for p in lora]
            with torch.no_grad():
                for p, e in zip(lora, ema):
                    p.copy_(e)
            pipe = StableDiffusionPipeline(vae=vae, text_encoder=te, tokenizer=tok, unet=model.module,
                                           scheduler=DDIMScheduler.from_config(noise_sched.config), safety_checker=None, feature_extractor=None,
                                           requires_safety_checker=False)
            pipe.set_progress_bar_config(disable=True)
            score = clip_score(rank, world_size, pipe, clip, proc, eval_prompts, device)
            with torch.no_grad():
                for p, b in zip(lora, backup):
                    p.copy_(b)
            if rank == 0:
                print(f"epoch {epoch} EMA CLIP score {score:.2f}", flush=True)
                os.makedirs(args.out, exist_ok=True)
                torch.save({"lora": get_peft_model_state_dict(model.module), "ema": [e.cpu() for e in ema],
                            "opt": opt.state_dict(), "epoch": epoch}, os.path.join(args.out, "last.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    args = get_args()
    world_size = args.gpus
    mp.spawn(worker, args=(world_size, args), nprocs=world_size, join=True)
