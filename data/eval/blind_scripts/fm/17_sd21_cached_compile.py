"""SD 2.1-base UNet fine-tuning from a precomputed latent/text-embedding cache.

Stage 1 (first run only): each rank encodes its own contiguous slice of the
image list with the frozen VAE + OpenCLIP text encoder and writes its own part
file. Stage 2: FSDP + torch.compile training on the cached tensors (~20k images,
about 4 GB of fp16 tensors, held in host memory).

    torchrun --nproc_per_node=8 17_sd21_cached_compile.py --images /data/art/list.tsv --cache /shared/cache/art
"""
import argparse
import functools
import math
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
import wandb
from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
from diffusers.models.attention import BasicTransformerBlock
from diffusers.models.resnet import ResnetBlock2D
from PIL import Image
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision, StateDictType
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms
from transformers import CLIPTextModel, CLIPTokenizer


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="stabilityai/stable-diffusion-2-1-base")
    ap.add_argument("--images", required=True, help="tsv: relative_path<TAB>caption")
    ap.add_argument("--cache", required=True, help="directory on shared storage")
    ap.add_argument("--out", default="runs/sd21-art")
    ap.add_argument("--res", type=int, default=512)
    ap.add_argument("--bs", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-6)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--wandb-project", default="sd21-art")
    ap.add_argument("--no-compile", action="store_true")
    return ap.parse_args()


@torch.no_grad()
def build_cache_part(args, rank, world, device):
    part_path = os.path.join(args.cache, f"part_{rank:02d}_of_{world:02d}.pt")
    if os.path.exists(part_path):
        return
    with open(args.images) as f:
        rows = [l.rstrip("\n").split("\t", 1) for l in f if l.strip()]
    per = math.ceil(len(rows) / world)
    mine = rows[rank * per: (rank + 1) * per]
    root = os.path.dirname(args.images)
    tf = transforms.Compose([transforms.Resize(args.res), transforms.CenterCrop(args.res),
                             transforms.ToTensor(), transforms.Normalize([0.5], [0.5])])
    vae = AutoencoderKL.from_pretrained(args.base, subfolder="vae").to(device).eval()
    tok = CLIPTokenizer.from_pretrained(args.base, subfolder="tokenizer")
    te = CLIPTextModel.from_pretrained(args.base, subfolder="text_encoder").to(device).eval()
    lats, embs = [], []
    for i in range(0, len(mine), 32):
        chunk = mine[i:i + 32]
        x = torch.stack([tf(Image.open(os.path.join(root, p)).convert("RGB")) for p, _ in chunk]).to(device)
        lats.append((vae.encode(x).latent_dist.mean * vae.config.scaling_factor).half().cpu())
        ids = tok([c for _, c in chunk], padding="max_length", max_length=tok.model_max_length,
                  truncation=True, return_tensors="pt").input_ids.to(device)
        embs.append(te(ids)[0].half().cpu())
    tmp = part_path + ".tmp"
    torch.save({"latents": torch.cat(lats), "text": torch.cat(embs)}, tmp)
    os.replace(tmp, part_path)
    del vae, te
    torch.cuda.empty_cache()


def load_cache(args, world):
    parts = [torch.load(os.path.join(args.cache, f"part_{r:02d}_of_{world:02d}.pt"), map_location="cpu")
             for r in range(world)]
    return TensorDataset(torch.cat([p["latents"] for p in parts]), torch.cat([p["text"] for p in parts]))


def main():
    args = get_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(rank)

    if rank == 0:
        os.makedirs(args.cache, exist_ok=True)
    dist.barrier()
    build_cache_part(args, rank, world, device)
    dist.barrier()  # every part must be on disk before anyone reads
    ds = load_cache(args, world)

    run = None
    if rank == 0:
        run = wandb.init(project=args.wandb_project, config=vars(args))

    unet = UNet2DConditionModel.from_pretrained(args.base, subfolder="unet")
    policy = functools.partial(transformer_auto_wrap_policy,
                               transformer_layer_cls={BasicTransformerBlock, ResnetBlock2D})
    unet = FSDP(unet, auto_wrap_policy=policy, device_id=device, use_orig_params=True,
                mixed_precision=MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32,
                                               buffer_dtype=torch.float32))
    train_unet = unet if args.no_compile else torch.compile(unet)
    scaler = ShardedGradScaler(init_scale=2.0 ** 14)
    optimizer = torch.optim.AdamW(unet.parameters(), lr=args.lr, weight_decay=1e-2)
    noise_sched = DDPMScheduler.from_pretrained(args.base, subfolder="scheduler")

    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=args.bs, sampler=sampler, num_workers=2, pin_memory=True, drop_last=True)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        train_unet.train()
        skipped = 0
        for lat, emb in loader:
            lat = lat.to(device, non_blocking=True).float()
            emb = emb.to(device, non_blocking=True)
            noise = torch.randn_like(lat)
            t = torch.randint(0, noise_sched.config.num_train_timesteps, (lat.shape[0],), device=device)
            noisy = noise_sched.add_noise(lat, noise, t)
            pred = train_unet(noisy, t, encoder_hidden_states=emb).sample
            loss = F.mse_loss(pred.float(), noise)

            # decide together: a rank that skipped backward alone would desynchronise the reduce-scatters
            bad = torch.tensor(0.0 if torch.isfinite(loss) else 1.0, device=device)
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
            if bad.item() > 0:
                skipped += 1
                optimizer.zero_grad(set_to_none=True)
                continue

            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            gnorm = unet.clip_grad_norm_(1.0)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            if step % 25 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if run is not None:
                    run.log({"loss": l.item(), "grad_norm": gnorm.item(), "loss_scale": scaler.get_scale(),
                             "epoch": epoch}, step=step)

        if rank == 0:
            print(f"epoch {epoch} done, step {step}, skipped {skipped} non-finite batches", flush=True)

        with FSDP.state_dict_type(unet, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(offload_to_cpu=True, rank0_only=True)):
            sd = unet.state_dict()
        if rank == 0:
            os.makedirs(args.out, exist_ok=True)
            torch.save(sd, os.path.join(args.out, f"unet_epoch{epoch:03d}.pt"))
        dist.barrier()

    if run is not None:
        run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
