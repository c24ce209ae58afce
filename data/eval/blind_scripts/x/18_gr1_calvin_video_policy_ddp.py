"""
GR-1 style GPT policy on CALVIN (ABC->D): a causal transformer over (language, static image,
gripper image, proprio) per step that predicts the arm action, the gripper action and the MAE
patch features of a future frame (video-prediction auxiliary loss).

    torchrun --nproc_per_node=8 train_gr1_calvin.py --calvin_root /data/calvin/task_ABC_D
"""
import argparse
import json
import math
import os

import numpy as np
import timm
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

import wandb


class CalvinWindows(Dataset):
    """Uses the lang-annotated segments of CALVIN (auto_lang_ann.npy) and the per-frame npz files."""

    def __init__(self, root, split, seq_len, future, lang_emb_file):
        ann = np.load(os.path.join(root, split, "lang_annotations", "auto_lang_ann.npy"), allow_pickle=True).item()
        self.root = os.path.join(root, split)
        self.seq_len, self.future = seq_len, future
        self.emb = np.load(lang_emb_file, allow_pickle=True).item()
        self.items = []
        for (s, e), text in zip(ann["info"]["indx"], ann["language"]["ann"]):
            for t in range(s, e - seq_len - future + 2):
                self.items.append((t, text))

    def __len__(self):
        return len(self.items)

    def _frame(self, i):
        return np.load(os.path.join(self.root, f"episode_{i:07d}.npz"))

    def __getitem__(self, idx):
        t0, text = self.items[idx]
        fr = [self._frame(t) for t in range(t0, t0 + self.seq_len + self.future)]
        static = np.stack([f["rgb_static"] for f in fr])
        gripper = np.stack([f["rgb_gripper"] for f in fr])
        state = np.stack([f["robot_obs"] for f in fr[: self.seq_len]]).astype(np.float32)
        acts = np.stack([f["rel_actions"] for f in fr[: self.seq_len]]).astype(np.float32)
        return {
            "static": torch.from_numpy(static).permute(0, 3, 1, 2),
            "gripper": torch.from_numpy(gripper).permute(0, 3, 1, 2),
            "state": torch.from_numpy(state),
            "arm": torch.from_numpy(acts[:, :6]),
            "grip": torch.from_numpy((acts[:, 6] > 0).astype(np.float32)),
            "lang": torch.from_numpy(self.emb[text]).float(),
        }


class GR1(nn.Module):
    def __init__(self, seq_len, dim=384, depth=12, heads=12, lang_dim=512, state_dim=15, mae_dim=768):
        super().__init__()
        self.seq_len = seq_len
        self.lang = nn.Linear(lang_dim, dim)
        self.state = nn.Linear(state_dim, dim)
        self.img = nn.Linear(mae_dim, dim)
        self.resampler_q = nn.Parameter(torch.randn(9, dim) * 0.02)
        self.resampler = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.obs_query = nn.Parameter(torch.randn(1, dim) * 0.02)
        self.act_query = nn.Parameter(torch.randn(1, dim) * 0.02)
        self.step_pos = nn.Parameter(torch.zeros(1, seq_len, 1, dim))
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, 0.1, batch_first=True, norm_first=True)
        self.gpt = nn.TransformerEncoder(layer, depth)
        self.arm_head = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, 6), nn.Tanh())
        self.grip_head = nn.Linear(dim, 1)
        self.frame_head = nn.Linear(dim, 2 * 196 * mae_dim // 16)  # pooled future patch features, both cameras

    def forward(self, lang, state, static_feat, grip_feat):
        B, T = state.shape[:2]
        def pool(f):  # [B*T, 197, 768] -> [B, T, 9, dim]
            q = self.resampler_q[None].expand(f.shape[0], -1, -1)
            return self.resampler(q, self.img(f), self.img(f), need_weights=False)[0].view(B, T, 9, -1)
        tok = torch.cat([self.lang(lang)[:, None, None].expand(B, T, 1, -1), self.state(state)[:, :, None],
                         pool(static_feat), pool(grip_feat),
                         self.obs_query[None, None].expand(B, T, 1, -1),
                         self.act_query[None, None].expand(B, T, 1, -1)], 2) + self.step_pos[:, :T]
        n = tok.shape[2]
        tok = tok.flatten(1, 2)
        # block-causal: a step attends to itself and the past
        step_id = torch.arange(T, device=tok.device).repeat_interleave(n)
        mask = step_id[None, :] > step_id[:, None]
        h = self.gpt(tok, mask=mask).view(B, T, n, -1)
        return self.arm_head(h[:, :, -1]), self.grip_head(h[:, :, -1]).squeeze(-1), self.frame_head(h[:, :, -2])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calvin_root", required=True)
    ap.add_argument("--lang_emb", default="calvin_clip_lang_emb.npy")
    ap.add_argument("--out", default="runs/gr1_abc_d")
    ap.add_argument("--seq_len", type=int, default=10)
    ap.add_argument("--future", type=int, default=3)
    ap.add_argument("--bs", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--video_loss_w", type=float, default=0.1)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(42)

    train_ds = CalvinWindows(args.calvin_root, "training", args.seq_len, args.future, args.lang_emb)
    val_ds = CalvinWindows(args.calvin_root, "validation", args.seq_len, args.future, args.lang_emb)
    train_dl = DataLoader(train_ds, batch_size=args.bs, shuffle=True, num_workers=12, pin_memory=True,
                          drop_last=True, persistent_workers=True, prefetch_factor=4)
    val_idx = list(range(rank, len(val_ds), world))[: 2000 // world]
    val_dl = DataLoader(torch.utils.data.Subset(val_ds, val_idx), batch_size=args.bs, num_workers=4)

    mae = timm.create_model("vit_base_patch16_224.mae", pretrained=True).to(device).eval().requires_grad_(False)
    mean = torch.tensor([0.485, 0.456, 0.406], device=device).view(1, 3, 1, 1)
    std = torch.tensor([0.229, 0.224, 0.225], device=device).view(1, 3, 1, 1)

    @torch.no_grad()
    def encode(frames):  # uint8 [B, T, 3, H, W] -> [B*T, 197, 768]
        x = frames.flatten(0, 1).float().div(255)
        x = F.interpolate(x, size=224, mode="bilinear", align_corners=False)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return mae.forward_features((x - mean) / std).float()

    model = GR1(args.seq_len).to(device)
    model = DDP(model, device_ids=[local_rank])
    torch.manual_seed(42 + rank)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = args.epochs * len(train_dl)
    warm = total // 20
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: s / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / (total - warm))))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        wandb.init(project="gr1-calvin", config=vars(args))
        with open(os.path.join(args.out, "args.json"), "w") as f:
            json.dump(vars(args), f)

    def losses(b):
        T = args.seq_len
        static_all = encode(b["static"]).view(b["static"].shape[0], -1, 197, 768)
        grip_all = encode(b["gripper"]).view(b["gripper"].shape[0], -1, 197, 768)
        arm, grip, frame = model(b["lang"], b["state"], static_all[:, :T].flatten(0, 1),
                                 grip_all[:, :T].flatten(0, 1))
        # future-frame target: MAE patch features of frame t+future (both cameras), channel-pooled 16x
        fut = torch.cat([static_all[:, args.future:args.future + T, 1:], grip_all[:, args.future:args.future + T, 1:]], 2)
        fut = F.avg_pool1d(fut.flatten(0, 1), 16).reshape(frame.shape)
        l_arm = F.smooth_l1_loss(arm, b["arm"])
        l_grip = F.binary_cross_entropy_with_logits(grip, b["grip"])
        l_vid = F.mse_loss(frame, fut)
        return l_arm + 0.01 * l_grip + args.video_loss_w * l_vid, l_arm, l_grip, l_vid

    step = 0
    for epoch in range(args.epochs):
        model.train()
        for b in train_dl:
            b = {k: v.to(device, non_blocking=True) for k, v in b.items()}
            loss, l_arm, l_grip, l_vid = losses(b)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1
            if step % 50 == 0:
                logs = torch.stack([l_arm, l_grip, l_vid]).detach()
                dist.all_reduce(logs, op=dist.ReduceOp.AVG)
                if rank == 0:
                    wandb.log({"train/arm": logs[0].item(), "train/grip": logs[1].item(), "train/video": logs[2].item(),
                               "lr": sched.get_last_lr()[0], "epoch": epoch}, step=step)

        model.eval()
        agg = torch.zeros(4, device=device)
        with torch.no_grad():
            for b in val_dl:
                b = {k: v.to(device, non_blocking=True) for k, v in b.items()}
                _, l_arm, l_grip, l_vid = losses(b)
                n = b["state"].shape[0]
                agg += torch.stack([l_arm * n, l_grip * n, l_vid * n, torch.tensor(float(n), device=device)])
        dist.all_reduce(agg)
        if rank == 0:
            wandb.log({"val/arm": (agg[0] / agg[3]).item(), "val/grip": (agg[1] / agg[3]).item(),
                       "val/video": (agg[2] / agg[3]).item()}, step=step)
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "epoch": epoch, "step": step},
                       os.path.join(args.out, f"epoch_{epoch:02d}.pt"))
        dist.barrier()

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
