"""SD 1.5 UNet fine-tune on pre-encoded VAE latents, DDP + EMA + gradient accumulation.

The VAE pass is done once: each rank encodes its own slice of the dataset into its own cache
file, then every rank loads all slices.

torchrun --nproc_per_node 8 13_ddp_sharded_latent_cache.py --manifest data/manifest.tsv --cache /scratch/lat --out runs/ft
"""
import argparse
import copy
import datetime
import hashlib
import logging
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler
from torchvision import transforms

from diffusers import AutoencoderKL, DDPMScheduler, UNet2DConditionModel
from diffusers.optimization import get_cosine_schedule_with_warmup
from transformers import CLIPTextModel, CLIPTokenizer

log = logging.getLogger("ft")


def cli():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="runwayml/stable-diffusion-v1-5")
    ap.add_argument("--manifest", required=True, help="tsv: image_path<TAB>caption")
    ap.add_argument("--cache", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--bs", type=int, default=16)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--val_frac", type=float, default=0.01)
    ap.add_argument("--p_uncond", type=float, default=0.1)
    ap.add_argument("--ema_decay", type=float, default=0.9999)
    ap.add_argument("--resume", default=None)
    return ap.parse_args()


@torch.no_grad()
def encode_slice(rows, vae, tok, device, bs=32):
    tf = transforms.Compose([transforms.Resize(512), transforms.CenterCrop(512), transforms.ToTensor(),
                             transforms.Normalize([0.5], [0.5])])
    lat, ids = [], []
    for i in range(0, len(rows), bs):
        chunk = rows[i:i + bs]
        x = torch.stack([tf(Image.open(p).convert("RGB")) for p, _ in chunk]).to(device, torch.float16)
        lat.append((vae.encode(x).latent_dist.sample() * vae.config.scaling_factor).half().cpu())
        ids.append(tok([c for _, c in chunk], padding="max_length", max_length=77, truncation=True,
                       return_tensors="pt").input_ids)
    return torch.cat(lat), torch.cat(ids)


def build_cache(rows, args, vae, tok, device, rank, world):
    key = hashlib.sha1(open(args.manifest, "rb").read()).hexdigest()[:10]
    os.makedirs(args.cache, exist_ok=True)
    path = lambda r: os.path.join(args.cache, f"{key}_w{world}_r{r}.pt")
    idx = list(range(rank, len(rows), world))
    if not os.path.exists(path(rank)):
        lat, ids = encode_slice([rows[i] for i in idx], vae, tok, device)
        tmp = path(rank) + f".tmp{os.getpid()}"
        torch.save({"idx": torch.tensor(idx), "lat": lat, "ids": ids}, tmp)
        os.replace(tmp, path(rank))
    dist.barrier()
    parts = [torch.load(path(r), map_location="cpu") for r in range(world)]
    order = torch.cat([p["idx"] for p in parts]).argsort()
    lat = torch.cat([p["lat"] for p in parts])[order]
    ids = torch.cat([p["ids"] for p in parts])[order]
    return lat, ids


@torch.no_grad()
def ema_step(ema, model, decay):
    for e, p in zip(ema.parameters(), model.parameters()):
        e.mul_(decay).add_(p, alpha=1 - decay)


def main():
    args = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    # the cache build can keep ranks apart for a while
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=90))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, format="%(asctime)s %(message)s")
    torch.manual_seed(17 + rank)

    with open(args.manifest) as f:
        rows = [tuple(l.rstrip("\n").split("\t", 1)) for l in f if l.strip()]
    tok = CLIPTokenizer.from_pretrained(args.base, subfolder="tokenizer")
    vae = AutoencoderKL.from_pretrained(args.base, subfolder="vae", torch_dtype=torch.float16).to(device).eval()
    lat, ids = build_cache(rows, args, vae, tok, device, rank, world)
    del vae
    torch.cuda.empty_cache()

    te = CLIPTextModel.from_pretrained(args.base, subfolder="text_encoder").to(device).eval().requires_grad_(False)
    unet = UNet2DConditionModel.from_pretrained(args.base, subfolder="unet").to(device)
    sched = DDPMScheduler.from_pretrained(args.base, subfolder="scheduler")
    with torch.no_grad():
        null_emb = te(tok([""], padding="max_length", max_length=77, return_tensors="pt").input_ids.to(device))[0]

    # fixed split: identical on every rank because it only depends on the dataset size
    n_val = max(1, int(len(rows) * args.val_frac))
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(len(rows), generator=g).tolist()
    full = TensorDataset(lat, ids)
    train_ds, val_ds = Subset(full, perm[n_val:]), Subset(full, perm[:n_val])
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=0, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler, num_workers=2, drop_last=True)
    # no padding for validation: each rank takes every world-th sample
    val_dl = DataLoader(Subset(val_ds, list(range(rank, len(val_ds), world))), batch_size=args.bs)

    ema = copy.deepcopy(unet).requires_grad_(False).eval()
    opt = torch.optim.AdamW(unet.parameters(), lr=args.lr, weight_decay=1e-2)
    total_updates = args.epochs * (len(train_dl) // args.accum)
    lr_sched = get_cosine_schedule_with_warmup(opt, 500, total_updates)
    start_epoch = 0
    if args.resume:
        ck = torch.load(args.resume, map_location="cpu")
        unet.load_state_dict(ck["unet"])
        ema.load_state_dict(ck["ema"])
        opt.load_state_dict(ck["opt"])
        lr_sched.load_state_dict(ck["sched"])
        start_epoch = ck["epoch"] + 1
    unet.enable_gradient_checkpointing()
    model = DDP(unet, device_ids=[local_rank], gradient_as_bucket_view=True)

    def loss_fn(net, z, input_ids, p_uncond):
        with torch.no_grad():
            c = te(input_ids)[0]
        if p_uncond > 0:
            c = torch.where(torch.rand(c.shape[0], 1, 1, device=device) < p_uncond, null_emb, c)
        noise = torch.randn_like(z)
        t = torch.randint(0, sched.config.num_train_timesteps, (z.shape[0],), device=device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = net(sched.add_noise(z, noise, t), t, c).sample
        return F.mse_loss(pred.float(), noise)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for i, (z, input_ids) in enumerate(train_dl):
            z, input_ids = z.to(device, non_blocking=True).float(), input_ids.to(device, non_blocking=True)
            last_micro = (i + 1) % args.accum == 0
            if last_micro:
                (loss_fn(model, z, input_ids, args.p_uncond) / args.accum).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                lr_sched.step()
                opt.zero_grad(set_to_none=True)
                ema_step(ema, model.module, args.ema_decay)
            else:
                with model.no_sync():
                    (loss_fn(model, z, input_ids, args.p_uncond) / args.accum).backward()

        # validation runs on the bare module (ranks may see a different number of batches),
        # the sum and count are reduced afterwards
        model.eval()
        stats = torch.zeros(2, device=device)
        torch.manual_seed(1234 + rank)
        with torch.no_grad():
            for z, input_ids in val_dl:
                z, input_ids = z.to(device).float(), input_ids.to(device)
                stats[0] += loss_fn(model.module, z, input_ids, 0.0) * z.shape[0]
                stats[1] += z.shape[0]
        dist.all_reduce(stats)
        if rank == 0:
            log.info("epoch %d  val loss %.5f  (%d samples)", epoch, (stats[0] / stats[1]).item(), int(stats[1]))
            os.makedirs(args.out, exist_ok=True)
            torch.save({"unet": model.module.state_dict(), "ema": ema.state_dict(), "opt": opt.state_dict(),
                        "sched": lr_sched.state_dict(), "epoch": epoch}, os.path.join(args.out, "last.pt"))
        dist.barrier()

    if rank == 0:
        ema.save_pretrained(os.path.join(args.out, "unet_ema"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
