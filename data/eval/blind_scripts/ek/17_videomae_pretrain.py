# VideoMAE self-supervised pre-training (ViT-B, tube masking 90%) on unlabeled video collections.
#   torchrun --nnodes=4 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=$HEAD_NODE:29500 \
#       17_videomae_pretrain.py --data_list /mnt/lab/lists/k400_ssv2_unlabeled.txt \
#       --output_dir /mnt/lab/exp/videomae_b_pt --use_wandb
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from decord import VideoReader, cpu
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler


def get_args():
    p = argparse.ArgumentParser("VideoMAE pre-training")
    p.add_argument("--data_list", required=True)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--num_frames", type=int, default=16)
    p.add_argument("--sampling_rate", type=int, default=4)
    p.add_argument("--mask_ratio", type=float, default=0.9)
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--epochs", type=int, default=800)
    p.add_argument("--warmup_epochs", type=int, default=40)
    p.add_argument("--blr", type=float, default=1.5e-4)
    p.add_argument("--min_lr", type=float, default=1e-5)
    p.add_argument("--weight_decay", type=float, default=0.05)
    p.add_argument("--num_workers", type=int, default=10)
    p.add_argument("--save_freq", type=int, default=20)
    p.add_argument("--use_wandb", action="store_true")
    return p.parse_args()


def sincos_table(n, d):
    t = np.arange(n)[:, None] / np.power(10000, 2 * (np.arange(d) // 2) / d)
    t[:, 0::2], t[:, 1::2] = np.sin(t[:, 0::2]), np.cos(t[:, 1::2])
    return torch.from_numpy(t).float()[None]


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, N, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, N, C))
        return x + self.mlp(self.norm2(x))


class PretrainVideoMAE(nn.Module):
    def __init__(self, num_frames=16, patch=16, tubelet=2, enc_dim=768, enc_depth=12, dec_dim=384, dec_depth=4):
        super().__init__()
        self.patch, self.tubelet = patch, tubelet
        self.num_patches = (num_frames // tubelet) * (224 // patch) ** 2
        self.encoder_patch_embed = nn.Conv3d(3, enc_dim, (tubelet, patch, patch), (tubelet, patch, patch))
        self.register_buffer("enc_pos", sincos_table(self.num_patches, enc_dim), persistent=False)
        self.encoder = nn.ModuleList([Block(enc_dim, 12) for _ in range(enc_depth)])
        self.encoder_norm = nn.LayerNorm(enc_dim)
        self.encoder_to_decoder = nn.Linear(enc_dim, dec_dim, bias=False)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, dec_dim))
        self.register_buffer("dec_pos", sincos_table(self.num_patches, dec_dim), persistent=False)
        self.decoder = nn.ModuleList([Block(dec_dim, 6) for _ in range(dec_depth)])
        self.decoder_norm = nn.LayerNorm(dec_dim)
        self.decoder_pred = nn.Linear(dec_dim, 3 * tubelet * patch * patch)
        nn.init.trunc_normal_(self.mask_token, std=0.02)

    def no_weight_decay(self):
        return {"mask_token"}

    def forward(self, x, mask):
        # x: B,3,T,H,W ; mask: B,N bool, True = masked (same number of True per sample)
        tok = self.encoder_patch_embed(x).flatten(2).transpose(1, 2) + self.enc_pos
        B, N, C = tok.shape
        vis = tok[~mask].reshape(B, -1, C)
        for blk in self.encoder:
            vis = blk(vis)
        vis = self.encoder_to_decoder(self.encoder_norm(vis))
        pos = self.dec_pos.expand(B, -1, -1)
        D = vis.shape[-1]
        full = torch.cat([vis + pos[~mask].reshape(B, -1, D),
                          self.mask_token + pos[mask].reshape(B, -1, D)], dim=1)
        for blk in self.decoder:
            full = blk(full)
        n_vis = vis.shape[1]
        return self.decoder_pred(self.decoder_norm(full[:, n_vis:]))

    def patchify_target(self, x, mask):
        # normalised pixels of every tubelet, as in VideoMAE (norm_pix_loss)
        B, C, T, H, W = x.shape
        t, p = self.tubelet, self.patch
        x = x.view(B, C, T // t, t, H // p, p, W // p, p).permute(0, 2, 4, 6, 3, 5, 7, 1)
        x = x.reshape(B, -1, t * p * p, C)
        x = (x - x.mean(-2, keepdim=True)) / (x.var(-2, unbiased=True, keepdim=True).sqrt() + 1e-6)
        x = x.flatten(2)
        return x[mask].reshape(B, -1, x.shape[-1])


class TubeMasking:
    def __init__(self, num_frames, tubelet, patch, ratio):
        self.frames = num_frames // tubelet
        self.per_frame = (224 // patch) ** 2
        self.n_mask = int(ratio * self.per_frame)

    def __call__(self):
        m = np.zeros(self.per_frame, dtype=bool)
        m[np.random.choice(self.per_frame, self.n_mask, replace=False)] = True
        return np.tile(m, self.frames)


class UnlabeledVideos(Dataset):
    def __init__(self, list_file, num_frames, rate, masker):
        with open(list_file) as f:
            self.paths = [l.strip() for l in f if l.strip()]
        self.num_frames, self.rate, self.masker = num_frames, rate, masker

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        vr = VideoReader(self.paths[i], ctx=cpu(0), num_threads=1)
        n, span = len(vr), self.num_frames * self.rate
        start = np.random.randint(0, max(n - span, 0) + 1)
        idx = np.minimum(np.arange(start, start + span, self.rate), n - 1)
        x = torch.from_numpy(vr.get_batch(idx).asnumpy()).permute(3, 0, 1, 2).float() / 255.0
        h, w = x.shape[-2:]
        scale = np.random.uniform(0.66, 1.0)
        ch, cw = int(min(h, w) * scale), int(min(h, w) * scale)
        t, l = np.random.randint(0, h - ch + 1), np.random.randint(0, w - cw + 1)
        x = F.interpolate(x[..., t:t + ch, l:l + cw], size=(224, 224), mode="bilinear", align_corners=False)
        if np.random.rand() < 0.5:
            x = x.flip(-1)
        x = (x - torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1, 1)) / torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1, 1)
        return x, torch.from_numpy(self.masker())


def main(args):
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(1234 + rank)
    np.random.seed(1234 + rank)

    wandb_run = None
    if args.use_wandb and rank == 0:
        import wandb
        wandb_run = wandb.init(project="videomae-pretrain", config=vars(args), resume="allow",
                               id=os.path.basename(args.output_dir.rstrip("/")))

    model = PretrainVideoMAE(args.num_frames).to(device)
    model = DDP(model, device_ids=[local_rank])
    skip = model.module.no_weight_decay()
    decay = [p for n, p in model.module.named_parameters() if p.ndim > 1 and n not in skip]
    no_decay = [p for n, p in model.module.named_parameters() if p.ndim <= 1 or n in skip]

    masker = TubeMasking(args.num_frames, 2, 16, args.mask_ratio)
    dataset = UnlabeledVideos(args.data_list, args.num_frames, args.sampling_rate, masker)
    sampler = DistributedSampler(dataset, shuffle=True, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=args.num_workers,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    lr = args.blr * args.batch_size * world / 256
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95))
    iters = len(loader)

    start_epoch = 0
    ckpt_path = os.path.join(args.output_dir, "checkpoint-latest.pth")
    if os.path.isfile(ckpt_path):
        ckpt = torch.load(ckpt_path, map_location="cpu")
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        start_epoch = ckpt["epoch"] + 1
        if rank == 0:
            print(f"auto-resumed from {ckpt_path} at epoch {start_epoch}")
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        print(f"{world} ranks x {args.batch_size} = {world * args.batch_size} clips/iter, lr {lr:.2e}")

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        meter = torch.zeros(2, device=device)
        for it, (x, mask) in enumerate(loader):
            e = epoch + it / iters
            cur = lr * e / args.warmup_epochs if e < args.warmup_epochs else args.min_lr + (lr - args.min_lr) * 0.5 * (
                1 + math.cos(math.pi * (e - args.warmup_epochs) / (args.epochs - args.warmup_epochs)))
            for g in optimizer.param_groups:
                g["lr"] = cur
            x = x.to(device, non_blocking=True)
            mask = mask.to(device, non_blocking=True)
            with torch.no_grad():
                target = model.module.patchify_target(x, mask)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = model(x, mask)
            loss = F.mse_loss(pred.float(), target)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            meter += torch.stack([loss.detach(), torch.ones((), device=device)])
            if rank == 0 and it % 100 == 0:
                print(f"epoch {epoch} [{it}/{iters}] loss {loss.item():.4f} lr {cur:.2e} "
                      f"{(time.time() - t0) / (it + 1):.2f}s/it", flush=True)
        dist.all_reduce(meter)
        epoch_loss = (meter[0] / meter[1]).item()
        if rank == 0:
            if wandb_run is not None:
                wandb_run.log({"loss": epoch_loss, "lr": cur, "epoch": epoch, "epoch_time": time.time() - t0})
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch,
                     "args": vars(args)}
            torch.save(state, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
            if (epoch + 1) % args.save_freq == 0:
                torch.save(state, os.path.join(args.output_dir, f"checkpoint-{epoch}.pth"))
        dist.barrier()

    if wandb_run is not None:
        wandb_run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(get_args())
