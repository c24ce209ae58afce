"""ControlNet (canny) training on SD 2.1 with the ControlNet sharded by FSDP.

The base UNet, VAE and text encoder are frozen and replicated in fp16; only the
ControlNet branch is trained.

    torchrun --nproc_per_node=8 16_controlnet_fsdp.py --data /data/canny_pairs --out runs/cn-canny
"""
import argparse
import functools
import os
import time

import cv2
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from diffusers import AutoencoderKL, ControlNetModel, DDPMScheduler, UNet2DConditionModel
from diffusers.models.attention import BasicTransformerBlock
from diffusers.models.resnet import ResnetBlock2D
from PIL import Image
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision, StateDictType
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms
from transformers import CLIPTextModel, CLIPTokenizer


class CannyPairs(Dataset):
    def __init__(self, root, tokenizer, res=768):
        self.root = root
        with open(os.path.join(root, "prompts.txt")) as f:
            self.items = [l.rstrip("\n").split("\t", 1) for l in f if l.strip()]
        self.tok = tokenizer
        self.tf = transforms.Compose([transforms.Resize(res), transforms.CenterCrop(res), transforms.ToTensor()])

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        name, prompt = self.items[i]
        img = Image.open(os.path.join(self.root, "images", name)).convert("RGB")
        img_t = self.tf(img)
        arr = (img_t.permute(1, 2, 0).numpy() * 255).astype(np.uint8)
        edges = cv2.Canny(arr, 100, 200)
        cond = torch.from_numpy(np.stack([edges] * 3, axis=0)).float() / 255.0
        ids = self.tok(prompt, padding="max_length", max_length=self.tok.model_max_length,
                       truncation=True, return_tensors="pt").input_ids[0]
        return img_t * 2 - 1, cond, ids


def save_controlnet(controlnet, path):
    cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(controlnet, StateDictType.FULL_STATE_DICT, cfg):
        state = controlnet.state_dict()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save(state, path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="stabilityai/stable-diffusion-2-1")
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--res", type=int, default=768)
    ap.add_argument("--bs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--proportion-empty-prompts", type=float, default=0.5)
    ap.add_argument("--save-every", type=int, default=2500)
    ap.add_argument("--log-every", type=int, default=50)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(42)  # identical ControlNet init everywhere; reseeded per rank below

    tokenizer = CLIPTokenizer.from_pretrained(args.base, subfolder="tokenizer")
    text_encoder = CLIPTextModel.from_pretrained(args.base, subfolder="text_encoder", torch_dtype=torch.float16)
    vae = AutoencoderKL.from_pretrained(args.base, subfolder="vae", torch_dtype=torch.float16)
    unet = UNet2DConditionModel.from_pretrained(args.base, subfolder="unet", torch_dtype=torch.float16)
    for m in (text_encoder, vae, unet):
        m.requires_grad_(False).eval().to(device)
    empty_ids = tokenizer("", padding="max_length", max_length=tokenizer.model_max_length,
                          return_tensors="pt").input_ids.to(device)

    controlnet = ControlNetModel.from_unet(
        UNet2DConditionModel.from_pretrained(args.base, subfolder="unet"))
    controlnet.enable_gradient_checkpointing()
    policy = functools.partial(transformer_auto_wrap_policy,
                               transformer_layer_cls={BasicTransformerBlock, ResnetBlock2D})
    controlnet = FSDP(controlnet, auto_wrap_policy=policy, device_id=device, use_orig_params=True,
                      mixed_precision=MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32,
                                                     buffer_dtype=torch.float32))
    torch.manual_seed(42 + rank)
    scaler = torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler()
    optimizer = torch.optim.AdamW(controlnet.parameters(), lr=args.lr, weight_decay=1e-2)
    noise_scheduler = DDPMScheduler.from_pretrained(args.base, subfolder="scheduler")

    ds = CannyPairs(args.data, tokenizer, args.res)
    sampler = DistributedSampler(ds, shuffle=True)
    loader = DataLoader(ds, batch_size=args.bs, sampler=sampler, num_workers=8, drop_last=True, pin_memory=True)

    step = 0
    t0 = time.time()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        controlnet.train()
        for pixels, cond, ids in loader:
            pixels = pixels.to(device, dtype=torch.float16, non_blocking=True)
            cond = cond.to(device, dtype=torch.float16, non_blocking=True)
            ids = ids.to(device, non_blocking=True)
            drop = torch.rand(ids.shape[0], device=device) < args.proportion_empty_prompts
            ids = torch.where(drop[:, None], empty_ids.expand_as(ids), ids)
            with torch.no_grad():
                latents = vae.encode(pixels).latent_dist.sample() * vae.config.scaling_factor
                text_emb = text_encoder(ids)[0]
            noise = torch.randn_like(latents)
            t = torch.randint(0, noise_scheduler.config.num_train_timesteps, (latents.shape[0],), device=device)
            noisy = noise_scheduler.add_noise(latents, noise, t)
            target = noise_scheduler.get_velocity(latents, noise, t)  # SD 2.1 is v-prediction

            down_res, mid_res = controlnet(noisy, t, encoder_hidden_states=text_emb,
                                           controlnet_cond=cond, return_dict=False)
            pred = unet(noisy, t, encoder_hidden_states=text_emb,
                        down_block_additional_residuals=[r.to(torch.float16) for r in down_res],
                        mid_block_additional_residual=mid_res.to(torch.float16)).sample
            loss = F.mse_loss(pred.float(), target.float())

            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            controlnet.clip_grad_norm_(1.0)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            if step % args.log_every == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"ep {epoch} step {step} loss {l.item():.5f} scale {scaler.get_scale():.0f} "
                          f"{(time.time() - t0) / args.log_every:.2f}s/it", flush=True)
                t0 = time.time()
            if step % args.save_every == 0:
                save_controlnet(controlnet, os.path.join(args.out, f"controlnet_{step:06d}.pt"))
                dist.barrier()

    save_controlnet(controlnet, os.path.join(args.out, "controlnet_final.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
