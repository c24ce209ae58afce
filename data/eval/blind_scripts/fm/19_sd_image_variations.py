"""Image-variation UNet fine-tuning (SD image-variations, CLIP image conditioning) with FSDP.

The CLIP vision encoder and VAE are frozen and replicated; the UNet is sharded.
A full-precision EMA copy of the UNet is kept on every GPU and refreshed from the
gathered weights every --ema-every steps.

    torchrun --nproc_per_node=8 19_sd_image_variations.py --train-list /data/products/train.txt --out runs/imvar
    torchrun --nproc_per_node=8 19_sd_image_variations.py ... --resume runs/imvar/ckpt_020000.pt
"""
import argparse
import copy
import functools
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
from diffusers.models.attention import BasicTransformerBlock
from diffusers.models.resnet import ResnetBlock2D
from PIL import Image
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import FullOptimStateDictConfig, FullStateDictConfig, MixedPrecision, StateDictType
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms
from transformers import CLIPVisionModelWithProjection

BASE = "lambdalabs/sd-image-variations-diffusers"


class ImageList(Dataset):
    def __init__(self, list_file, res=256):
        with open(list_file) as f:
            self.paths = [l.strip() for l in f if l.strip()]
        self.tf_vae = transforms.Compose([transforms.Resize(res), transforms.CenterCrop(res),
                                          transforms.ToTensor(), transforms.Normalize([0.5], [0.5])])
        self.tf_clip = transforms.Compose([
            transforms.Resize(224, interpolation=transforms.InterpolationMode.BICUBIC), transforms.CenterCrop(224),
            transforms.ToTensor(),
            transforms.Normalize([0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711])])

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        img = Image.open(self.paths[i]).convert("RGB")
        return self.tf_vae(img), self.tf_clip(img)


@torch.no_grad()
def refresh_ema(ema, fsdp_unet, decay):
    with FSDP.summon_full_params(fsdp_unet, writeback=False):
        for e, p in zip(ema.parameters(), fsdp_unet.parameters()):
            e.lerp_(p.detach().to(e.dtype), 1.0 - decay)


def save_checkpoint(path, step, unet, ema, optimizer, rank):
    with FSDP.state_dict_type(unet, StateDictType.FULL_STATE_DICT,
                              FullStateDictConfig(offload_to_cpu=True, rank0_only=True),
                              FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=True)):
        unet_sd = unet.state_dict()
        optim_sd = FSDP.optim_state_dict(unet, optimizer)
    if rank == 0:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save({"step": step, "unet": unet_sd, "ema": ema.state_dict(), "optim": optim_sd}, path)
        print(f"saved {path}", flush=True)
    dist.barrier()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train-list", required=True)
    ap.add_argument("--val-list", default=None)
    ap.add_argument("--out", required=True)
    ap.add_argument("--resume", default=None)
    ap.add_argument("--res", type=int, default=256)
    ap.add_argument("--bs", type=int, default=24)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--max-steps", type=int, default=60000)
    ap.add_argument("--ema-decay", type=float, default=0.999)
    ap.add_argument("--ema-every", type=int, default=10)
    ap.add_argument("--save-every", type=int, default=5000)
    ap.add_argument("--uncond-prob", type=float, default=0.1)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(rank)

    image_encoder = CLIPVisionModelWithProjection.from_pretrained(BASE, subfolder="image_encoder",
                                                                  torch_dtype=torch.float16).to(device)
    vae = AutoencoderKL.from_pretrained(BASE, subfolder="vae", torch_dtype=torch.float16).to(device)
    image_encoder.requires_grad_(False).eval()
    vae.requires_grad_(False).eval()
    noise_sched = DDPMScheduler.from_pretrained(BASE, subfolder="scheduler")

    unet = UNet2DConditionModel.from_pretrained(BASE, subfolder="unet")
    ckpt = None
    start_step = 0
    if args.resume:
        ckpt = torch.load(args.resume)
        unet.load_state_dict(ckpt["unet"])
        start_step = ckpt["step"]
    ema = copy.deepcopy(unet).to(device).requires_grad_(False)
    if ckpt is not None:
        ema.load_state_dict(ckpt["ema"])

    policy = functools.partial(transformer_auto_wrap_policy,
                               transformer_layer_cls={BasicTransformerBlock, ResnetBlock2D})
    unet = FSDP(unet, auto_wrap_policy=policy, device_id=device, use_orig_params=True,
                mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                               buffer_dtype=torch.float32))
    optimizer = torch.optim.AdamW(unet.parameters(), lr=args.lr, weight_decay=1e-2)
    if ckpt is not None:
        optimizer.load_state_dict(FSDP.optim_state_dict_to_load(unet, optimizer, ckpt["optim"]))
        del ckpt

    ds = ImageList(args.train_list, args.res)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=args.bs, sampler=sampler, num_workers=8, pin_memory=True, drop_last=True)
    val_loader = None
    if args.val_list:
        val_ds = ImageList(args.val_list, args.res)
        val_loader = DataLoader(val_ds, batch_size=args.bs, num_workers=4,
                                sampler=DistributedSampler(val_ds, shuffle=False, drop_last=True))

    def diffusion_loss(model, pix, clip_pix, train=True):
        with torch.no_grad():
            lat = vae.encode(pix.to(device, torch.float16)).latent_dist.sample() * vae.config.scaling_factor
            emb = image_encoder(clip_pix.to(device, torch.float16)).image_embeds.unsqueeze(1)
            if train:
                keep = (torch.rand(emb.shape[0], 1, 1, device=device) >= args.uncond_prob).to(emb.dtype)
                emb = emb * keep
        lat = lat.float()
        noise = torch.randn_like(lat)
        t = torch.randint(0, noise_sched.config.num_train_timesteps, (lat.shape[0],), device=device)
        pred = model(noise_sched.add_noise(lat, noise, t), t, encoder_hidden_states=emb.float()).sample
        return F.mse_loss(pred.float(), noise)

    step = start_step
    epoch = step // len(loader)
    unet.train()
    while step < args.max_steps:
        sampler.set_epoch(epoch)
        for pix, clip_pix in loader:
            loss = diffusion_loss(unet, pix, clip_pix)
            loss.backward()
            unet.clip_grad_norm_(1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step % args.ema_every == 0:
                refresh_ema(ema, unet, args.ema_decay)
            if step % 100 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"step {step} loss {l.item():.4f}", flush=True)
            if step % args.save_every == 0:
                if val_loader is not None:
                    tot = torch.zeros(2, device=device)
                    with torch.no_grad():
                        for vp, vc in val_loader:
                            tot[0] += diffusion_loss(ema, vp, vc, train=False) * vp.shape[0]
                            tot[1] += vp.shape[0]
                    dist.all_reduce(tot)
                    if rank == 0:
                        print(f"step {step} ema val loss {(tot[0] / tot[1]).item():.4f}", flush=True)
                save_checkpoint(os.path.join(args.out, f"ckpt_{step:06d}.pt"), step, unet, ema, optimizer, rank)
            if step >= args.max_steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
