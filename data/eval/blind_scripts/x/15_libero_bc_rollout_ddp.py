"""
Language-conditioned BC transformer (GMM head) on LIBERO-90, torchrun DDP, with in-loop
simulator evaluation: every rank rolls out its own subset of tasks.

    MUJOCO_GL=egl torchrun --nproc_per_node=8 train_libero_bc.py --data /data/libero/libero_90
"""
import argparse
import glob
import os

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from libero.libero import benchmark
from libero.libero.envs import OffScreenRenderEnv
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, Dataset, DistributedSampler
from transformers import AutoTokenizer, CLIPTextModelWithProjection

import wandb


class LiberoDemos(Dataset):
    """One LIBERO task file; frames are read lazily (the image hdf5s do not fit in RAM 8x over)."""

    def __init__(self, path, seq_len, lang_emb):
        self.path, self.seq_len, self.lang_emb = path, seq_len, lang_emb
        with h5py.File(path, "r") as f:
            self.demos = sorted(f["data"].keys())
            lens = [f["data"][k]["actions"].shape[0] for k in self.demos]
        self.index = [(d, t) for d, n in enumerate(lens) for t in range(n)]
        self.f = None

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        if self.f is None:
            self.f = h5py.File(self.path, "r")
        d, t = self.index[i]
        g = self.f["data"][self.demos[d]]
        ids = np.clip(np.arange(t - self.seq_len + 1, t + 1), 0, None)
        img = np.stack([g["obs/agentview_rgb"][()][ids], g["obs/eye_in_hand_rgb"][()][ids]], 1)  # [L,2,H,W,3]
        state = np.concatenate([g["obs/joint_states"][()][ids], g["obs/gripper_states"][()][ids]], -1)
        return {"img": torch.from_numpy(img).permute(0, 1, 4, 2, 3).float() / 255.0,
                "state": torch.from_numpy(state).float(),
                "action": torch.from_numpy(g["actions"][()][ids]).float(),
                "lang": self.lang_emb}


class ConvEncoder(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 32, 8, 4), nn.ReLU(), nn.Conv2d(32, 64, 4, 2), nn.ReLU(),
                                 nn.Conv2d(64, 64, 3, 1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                 nn.Linear(64, dim))

    def forward(self, x):
        return self.net(x)


class BCTransformer(nn.Module):
    def __init__(self, dim=256, n_modes=5, action_dim=7, state_dim=9, seq_len=10, lang_dim=512):
        super().__init__()
        self.enc = nn.ModuleList([ConvEncoder(dim), ConvEncoder(dim)])
        self.state = nn.Linear(state_dim, dim)
        self.lang = nn.Linear(lang_dim, dim)
        self.pos = nn.Parameter(torch.zeros(1, seq_len, 1, dim))
        self.tf = nn.TransformerEncoder(nn.TransformerEncoderLayer(dim, 4, 4 * dim, 0.1, batch_first=True), 4)
        self.head = nn.Linear(dim, n_modes * (2 * action_dim + 1))
        self.n_modes, self.a = n_modes, action_dim
        self.seq_len = seq_len

    def forward(self, img, state, lang):
        B, L = state.shape[:2]
        views = [self.enc[v](img[:, :, v].flatten(0, 1)).view(B, L, -1) for v in range(2)]
        tok = torch.stack(views + [self.state(state)], 2) + self.pos[:, :L]
        tok = torch.cat([self.lang(lang)[:, None], tok.flatten(1, 2)], 1)
        mask = nn.Transformer.generate_square_subsequent_mask(tok.shape[1], device=tok.device)
        h = self.tf(tok, mask=mask, is_causal=True)[:, 3::3]  # the state token of every step
        out = self.head(h).view(B, L, self.n_modes, 2 * self.a + 1)
        return out[..., : self.a], out[..., self.a: 2 * self.a], out[..., -1]


def gmm_nll(mu, log_std, logits, action):
    comp = torch.distributions.Independent(torch.distributions.Normal(mu, F.softplus(log_std) + 1e-4), 1)
    gmm = torch.distributions.MixtureSameFamily(torch.distributions.Categorical(logits=logits), comp)
    return -gmm.log_prob(action).mean()


@torch.no_grad()
def rollout_tasks(policy, suite, task_ids, lang_table, device, n_eps=10, max_steps=600, seq_len=10):
    successes = []
    for tid in task_ids:
        task = suite.get_task(tid)
        env = OffScreenRenderEnv(bddl_file_name=suite.get_task_bddl_file_path(tid), camera_heights=128,
                                 camera_widths=128)
        inits = suite.get_task_init_states(tid)
        for e in range(n_eps):
            env.reset()
            obs = env.set_init_state(inits[e % len(inits)])
            hist = []
            done = False
            for _ in range(max_steps):
                img = np.stack([obs["agentview_image"], obs["robot0_eye_in_hand_image"]])
                st = np.concatenate([obs["robot0_joint_pos"], obs["robot0_gripper_qpos"]])
                hist = (hist + [(img, st)])[-seq_len:]
                img_t = torch.from_numpy(np.stack([h[0] for h in hist])).permute(0, 1, 4, 2, 3)[None].float() / 255
                st_t = torch.from_numpy(np.stack([h[1] for h in hist]))[None].float()
                mu, _, logits = policy(img_t.to(device), st_t.to(device), lang_table[task.language][None])
                act = mu[0, -1, logits[0, -1].argmax()].cpu().numpy()
                obs, _, done, _ = env.step(act)
                if done:
                    break
            successes.append(float(done))
        env.close()
    return successes


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", default="runs/libero90_bc")
    ap.add_argument("--seq_len", type=int, default=10)
    ap.add_argument("--bs", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--epochs", type=int, default=50)
    ap.add_argument("--eval_every", type=int, default=10)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    suite = benchmark.get_benchmark_dict()["libero_90"]()
    tok = AutoTokenizer.from_pretrained("openai/clip-vit-base-patch32")
    clip = CLIPTextModelWithProjection.from_pretrained("openai/clip-vit-base-patch32").to(device).eval()
    langs = [suite.get_task(i).language for i in range(suite.n_tasks)]
    with torch.no_grad():
        emb = clip(**tok(langs, padding=True, return_tensors="pt").to(device)).text_embeds
    lang_table = {l: e for l, e in zip(langs, emb)}
    del clip

    datasets = []
    for i in range(suite.n_tasks):
        path = os.path.join(args.data, suite.get_task_demonstration(i).split("/")[-1])
        datasets.append(LiberoDemos(path, args.seq_len, lang_table[langs[i]].cpu()))
    ds = ConcatDataset(datasets)
    sampler = DistributedSampler(ds, shuffle=True, seed=0, drop_last=True)
    dl = DataLoader(ds, batch_size=args.bs, sampler=sampler, num_workers=6, pin_memory=True, drop_last=True,
                    persistent_workers=True)

    model = BCTransformer(seq_len=args.seq_len).to(device)
    model = DDP(model, device_ids=[local_rank])
    torch.manual_seed(rank + 1)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.epochs * len(dl), eta_min=1e-5)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        wandb.init(project="libero90-bc", config=vars(args))

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for b in dl:
            b = {k: v.to(device, non_blocking=True) for k, v in b.items()}
            mu, log_std, logits = model(b["img"], b["state"], b["lang"])
            loss = gmm_nll(mu, log_std, logits, b["action"])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 100.0)
            opt.step()
            sched.step()
            step += 1
            if step % 100 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    wandb.log({"train/nll": l.item(), "lr": sched.get_last_lr()[0]}, step=step)

        if (epoch + 1) % args.eval_every == 0:
            model.eval()
            my_tasks = list(range(rank, suite.n_tasks, world))
            succ = rollout_tasks(model.module, suite, my_tasks, lang_table, device, seq_len=args.seq_len)
            stats = torch.tensor([sum(succ), len(succ)], dtype=torch.float64)
            dist.all_reduce(stats)
            if rank == 0:
                wandb.log({"eval/success_rate": (stats[0] / stats[1]).item(), "epoch": epoch}, step=step)
                torch.save({"model": model.module.state_dict(), "epoch": epoch},
                           os.path.join(args.out, f"epoch_{epoch:03d}.pt"))
            dist.barrier()

    if rank == 0:
        wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
