"""
ACT (Action Chunking Transformer) on LeRobot ALOHA datasets, multi-GPU with torchrun.

    torchrun --nproc_per_node=4 train_act.py --repo_id lerobot/aloha_sim_transfer_cube_human \
        --out outputs/act_cube --resume outputs/act_cube/last.pt
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torchvision
from lerobot.common.datasets.lerobot_dataset import LeRobotDataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import DataLoader, DistributedSampler

import wandb

CAMERA = "observation.images.top"


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--repo_id", default="lerobot/aloha_sim_transfer_cube_human")
    p.add_argument("--out", default="outputs/act")
    p.add_argument("--chunk", type=int, default=100)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--latent_dim", type=int, default=32)
    p.add_argument("--kl_weight", type=float, default=10.0)
    p.add_argument("--batch_size", type=int, default=8, help="per GPU")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--lr_backbone", type=float, default=1e-5)
    p.add_argument("--steps", type=int, default=100_000)
    p.add_argument("--save_every", type=int, default=10_000)
    p.add_argument("--eval_every", type=int, default=5_000)
    p.add_argument("--resume", default=None)
    p.add_argument("--seed", type=int, default=1000)
    return p.parse_args()


class ACT(nn.Module):
    def __init__(self, state_dim, action_dim, chunk, dim, latent_dim):
        super().__init__()
        bb = torchvision.models.resnet18(weights="IMAGENET1K_V1", norm_layer=torchvision.ops.FrozenBatchNorm2d)
        self.backbone = nn.Sequential(*list(bb.children())[:-2])
        self.img_proj = nn.Conv2d(512, dim, 1)
        self.chunk, self.latent_dim = chunk, latent_dim
        # CVAE encoder: [cls, state, a_1..a_k] -> (mu, logvar)
        self.vae_cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.vae_state = nn.Linear(state_dim, dim)
        self.vae_action = nn.Linear(action_dim, dim)
        self.vae_pos = nn.Parameter(torch.randn(1, chunk + 2, dim) * 0.02)
        self.vae_enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(dim, 8, 3200, 0.1, batch_first=True), 4)
        self.vae_out = nn.Linear(dim, 2 * latent_dim)
        # policy
        self.latent_proj = nn.Linear(latent_dim, dim)
        self.state_proj = nn.Linear(state_dim, dim)
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(dim, 8, 3200, 0.1, batch_first=True), 4)
        self.dec = nn.TransformerDecoder(nn.TransformerDecoderLayer(dim, 8, 3200, 0.1, batch_first=True), 7)
        self.query = nn.Embedding(chunk, dim)
        self.img_pos = nn.Parameter(torch.randn(1, 300, dim) * 0.02)
        self.head = nn.Linear(dim, action_dim)

    def forward(self, image, state, actions=None, is_pad=None):
        B = state.shape[0]
        if actions is not None:
            tok = torch.cat([self.vae_cls.expand(B, -1, -1), self.vae_state(state)[:, None],
                             self.vae_action(actions)], 1) + self.vae_pos
            pad = torch.cat([torch.zeros(B, 2, dtype=torch.bool, device=state.device), is_pad], 1)
            mu, logvar = self.vae_out(self.vae_enc(tok, src_key_padding_mask=pad)[:, 0]).chunk(2, -1)
            z = mu + torch.randn_like(mu) * (0.5 * logvar).exp()
        else:
            mu = logvar = None
            z = torch.zeros(B, self.latent_dim, device=state.device)
        feat = self.img_proj(self.backbone(image)).flatten(2).transpose(1, 2)
        feat = feat + self.img_pos[:, : feat.shape[1]]
        mem = torch.cat([self.latent_proj(z)[:, None], self.state_proj(state)[:, None], feat], 1)
        mem = self.enc(mem)
        out = self.dec(self.query.weight[None].expand(B, -1, -1), mem)
        return self.head(out), mu, logvar


def normalize(batch, stats, device):
    img = batch[CAMERA].to(device, non_blocking=True)
    img = torchvision.transforms.functional.normalize(img, [0.485, 0.456, 0.406], [0.229, 0.224, 0.225])
    s = (batch["observation.state"].to(device) - stats["s_mean"]) / stats["s_std"]
    a = (batch["action"].to(device) - stats["a_mean"]) / stats["a_std"]
    return img, s, a, batch["action_is_pad"].to(device)


def act_loss(model, img, s, a, pad, kl_weight):
    pred, mu, logvar = model(img, s, a, pad)
    l1 = (F.l1_loss(pred, a, reduction="none") * ~pad.unsqueeze(-1)).mean()
    kl = (-0.5 * (1 + logvar - mu.pow(2) - logvar.exp())).sum(-1).mean()
    return l1 + kl_weight * kl, l1, kl


def save(path, model, ema, opt, step):
    torch.save({"model": model.module.state_dict(), "ema": ema.module.state_dict(),
                "opt": opt.state_dict(), "step": step}, path)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed + rank)

    fps = 50
    ds = LeRobotDataset(args.repo_id, delta_timestamps={"action": [i / fps for i in range(args.chunk)]})
    st = ds.meta.stats
    stats = {"s_mean": st["observation.state"]["mean"].to(device), "s_std": st["observation.state"]["std"].to(device),
             "a_mean": st["action"]["mean"].to(device), "a_std": st["action"]["std"].to(device)}
    n_val = len(ds) // 20
    train_ds, val_ds = torch.utils.data.random_split(ds, [len(ds) - n_val, n_val],
                                                     generator=torch.Generator().manual_seed(0))
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    val_sampler = DistributedSampler(val_ds, shuffle=False, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, num_workers=8,
                          pin_memory=True, drop_last=True, persistent_workers=True)
    val_dl = DataLoader(val_ds, batch_size=args.batch_size, sampler=val_sampler, num_workers=4)

    state_dim = ds.meta.features["observation.state"]["shape"][0]
    action_dim = ds.meta.features["action"]["shape"][0]
    model = ACT(state_dim, action_dim, args.chunk, args.dim, args.latent_dim).to(device)
    model = DDP(model, device_ids=[local_rank])
    ema = AveragedModel(model.module, multi_avg_fn=get_ema_multi_avg_fn(0.999))

    backbone = [p for n, p in model.module.named_parameters() if n.startswith("backbone") and p.requires_grad]
    rest = [p for n, p in model.module.named_parameters() if not n.startswith("backbone") and p.requires_grad]
    opt = torch.optim.AdamW([{"params": rest}, {"params": backbone, "lr": args.lr_backbone}],
                            lr=args.lr, weight_decay=1e-4)

    step = 0
    if args.resume and os.path.exists(args.resume):
        ckpt = torch.load(args.resume)
        model.module.load_state_dict(ckpt["model"])
        ema.module.load_state_dict(ckpt["ema"])
        opt.load_state_dict(ckpt["opt"])
        step = ckpt["step"]
        if rank == 0:
            print(f"resumed from {args.resume} @ {step}")
        del ckpt

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        wandb.init(project="act-aloha", name=os.path.basename(args.out), config=vars(args), resume="allow")

    epoch = step // len(train_dl)
    t0 = time.time()
    while step < args.steps:
        train_sampler.set_epoch(epoch)
        model.train()
        for batch in train_dl:
            img, s, a, pad = normalize(batch, stats, device)
            loss, l1, kl = act_loss(model, img, s, a, pad, args.kl_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            ema.update_parameters(model.module)
            step += 1

            if step % 100 == 0:
                logs = torch.stack([loss.detach(), l1.detach(), kl.detach()])
                dist.all_reduce(logs, op=dist.ReduceOp.AVG)
                if rank == 0:
                    wandb.log({"train/loss": logs[0].item(), "train/l1": logs[1].item(), "train/kl": logs[2].item(),
                               "it_per_s": 100 / (time.time() - t0)}, step=step)
                t0 = time.time()

            if step % args.eval_every == 0:
                ema.eval()
                tot = torch.zeros(2, device=device)
                with torch.no_grad():
                    for vb in val_dl:
                        img, s, a, pad = normalize(vb, stats, device)
                        pred, _, _ = ema.module(img, s)
                        err = (F.l1_loss(pred, a, reduction="none") * ~pad.unsqueeze(-1)).sum()
                        tot += torch.stack([err, (~pad).sum() * a.shape[-1]])
                dist.all_reduce(tot)
                if rank == 0:
                    wandb.log({"val/l1_ema_prior": (tot[0] / tot[1]).item()}, step=step)
                model.train()

            if step % args.save_every == 0 and rank == 0:
                save(os.path.join(args.out, f"step_{step}.pt"), model, ema, opt, step)
                save(os.path.join(args.out, "last.pt"), model, ema, opt, step)
            if step >= args.steps:
                break
        epoch += 1

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
