"""Multitask BC on LIBERO-10 with periodic closed-loop evaluation on every task.
Rollouts for each task are split over ranks by initial state.

    MUJOCO_GL=egl torchrun --nproc_per_node=8 13_libero_multitask_eval.py --suite libero_10
"""
import argparse
import os

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from libero.libero import benchmark, get_libero_path
from libero.libero.envs import OffScreenRenderEnv
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import ConcatDataset, DataLoader, Dataset, DistributedSampler
from torch.utils.tensorboard import SummaryWriter


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--suite", default="libero_10")
    p.add_argument("--out", default="experiments/libero_bc")
    p.add_argument("--seq_len", type=int, default=10)
    p.add_argument("--img", type=int, default=128)
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--epochs", type=int, default=50)
    p.add_argument("--eval_every", type=int, default=5)
    p.add_argument("--n_eval", type=int, default=50, help="episodes per task")
    p.add_argument("--max_steps", type=int, default=600)
    p.add_argument("--seed", type=int, default=10000)
    return p.parse_args()


class TaskDemoDataset(Dataset):
    def __init__(self, path, task_id, seq_len):
        self.task_id, self.seq_len = task_id, seq_len
        self.data = []
        with h5py.File(path, "r") as f:
            for k in f["data"]:
                g = f[f"data/{k}"]
                self.data.append((g["obs/agentview_rgb"][()], g["obs/eye_in_hand_rgb"][()],
                                  np.concatenate([g["obs/joint_states"][()], g["obs/gripper_states"][()]], -1),
                                  g["actions"][()]))
        self.index = [(d, t) for d, ep in enumerate(self.data) for t in range(len(ep[3]))]

    def __len__(self):
        return len(self.index)

    def __getitem__(self, i):
        d, t = self.index[i]
        agent, wrist, prop, act = self.data[d]
        idx = np.minimum(np.arange(t, t + self.seq_len), len(act) - 1)
        return {
            "agent": torch.from_numpy(agent[idx]).permute(0, 3, 1, 2),
            "wrist": torch.from_numpy(wrist[idx]).permute(0, 3, 1, 2),
            "prop": torch.from_numpy(prop[idx]).float(),
            "action": torch.from_numpy(act[idx]).float(),
            "task": torch.tensor(self.task_id),
        }


class ConvEncoder(nn.Module):
    def __init__(self, out=256):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, 32, 5, 2, 2), nn.GroupNorm(8, 32), nn.ReLU(),
            nn.Conv2d(32, 64, 3, 2, 1), nn.GroupNorm(8, 64), nn.ReLU(),
            nn.Conv2d(64, 128, 3, 2, 1), nn.GroupNorm(16, 128), nn.ReLU(),
            nn.Conv2d(128, 128, 3, 2, 1), nn.GroupNorm(16, 128), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, out))

    def forward(self, x):
        return self.net(x)


class BCTransformer(nn.Module):
    def __init__(self, n_tasks, prop_dim=9, act_dim=7, d=256, seq_len=10):
        super().__init__()
        self.agent_enc, self.wrist_enc = ConvEncoder(d), ConvEncoder(d)
        self.prop = nn.Linear(prop_dim, d)
        self.task_emb = nn.Embedding(n_tasks, d)
        self.pos = nn.Parameter(torch.zeros(1, seq_len, d))
        self.tf = nn.TransformerEncoder(nn.TransformerEncoderLayer(d, 8, 4 * d, 0.1, batch_first=True), 4)
        self.head = nn.Sequential(nn.Linear(d, 256), nn.ReLU(), nn.Linear(256, act_dim))
        self.register_buffer("mask", torch.triu(torch.full((seq_len, seq_len), float("-inf")), 1))

    def forward(self, agent, wrist, prop, task):
        B, T = agent.shape[:2]
        a = self.agent_enc(agent.flatten(0, 1).float() / 255.0).view(B, T, -1)
        w = self.wrist_enc(wrist.flatten(0, 1).float() / 255.0).view(B, T, -1)
        h = a + w + self.prop(prop) + self.task_emb(task)[:, None] + self.pos[:, :T]
        return self.head(self.tf(h, mask=self.mask[:T, :T]))


@torch.no_grad()
def eval_task(policy, task, init_states, args, device, task_id):
    env_args = {"bddl_file_name": os.path.join(get_libero_path("bddl_files"), task.problem_folder, task.bddl_file),
                "camera_heights": args.img, "camera_widths": args.img}
    env = OffScreenRenderEnv(**env_args)
    results = []
    for init in init_states:
        env.reset()
        obs = env.set_init_state(init)
        for _ in range(5):  # let objects settle
            obs, _, _, _ = env.step(np.zeros(7))
        hist, success = [], False
        for _ in range(args.max_steps):
            hist.append(obs)
            hist = hist[-args.seq_len:]
            agent = torch.from_numpy(np.stack([o["agentview_image"][::-1] for o in hist]).copy())
            wrist = torch.from_numpy(np.stack([o["robot0_eye_in_hand_image"][::-1] for o in hist]).copy())
            prop = np.stack([np.concatenate([o["robot0_joint_pos"], o["robot0_gripper_qpos"]]) for o in hist])
            act = policy(agent.permute(0, 3, 1, 2)[None].to(device), wrist.permute(0, 3, 1, 2)[None].to(device),
                         torch.from_numpy(prop).float()[None].to(device),
                         torch.tensor([task_id], device=device))[0, -1]
            obs, _, done, _ = env.step(act.clamp(-1, 1).cpu().numpy())
            if done:
                success = True
                break
        results.append(float(success))
    env.close()
    return torch.tensor(results, device=device)


def main():
    args = parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed + rank)

    suite = benchmark.get_benchmark_dict()[args.suite]()
    n_tasks = suite.n_tasks
    demo_root = get_libero_path("datasets")
    dataset = ConcatDataset([TaskDemoDataset(os.path.join(demo_root, suite.get_task_demonstration(i)), i,
                                             args.seq_len) for i in range(n_tasks)])
    sampler = DistributedSampler(dataset, shuffle=True, drop_last=True)
    loader = DataLoader(dataset, args.batch_size, sampler=sampler, num_workers=6, pin_memory=True, drop_last=True)

    model = DDP(BCTransformer(n_tasks, seq_len=args.seq_len).to(device), device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.epochs * len(loader), eta_min=1e-5)
    writer = SummaryWriter(args.out) if rank == 0 else None

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        acc = torch.zeros(2, device=device)
        for batch in loader:
            b = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            pred = model(b["agent"], b["wrist"], b["prop"], b["task"])
            loss = F.mse_loss(pred, b["action"])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 100.0)
            opt.step()
            sched.step()
            acc += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(acc)
        if rank == 0:
            writer.add_scalar("train/loss", (acc[0] / acc[1]).item(), epoch)

        if (epoch + 1) % args.eval_every == 0:
            model.eval()
            rates = []
            for task_id in range(n_tasks):
                init_states = suite.get_task_init_states(task_id)[:args.n_eval]
                local = eval_task(model.module, suite.get_task(task_id), init_states[rank::world], args, device,
                                  task_id)
                gathered = [torch.zeros_like(local) for _ in range(world)]
                dist.all_gather(gathered, local)
                rates.append(torch.cat(gathered).mean().item())
            if rank == 0:
                for task_id, r in enumerate(rates):
                    writer.add_scalar(f"eval/task_{task_id}", r, epoch)
                writer.add_scalar("eval/success_mean", float(np.mean(rates)), epoch)
                torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                            "epoch": epoch, "success": rates}, os.path.join(args.out, f"ep{epoch + 1}.pth"))
            dist.barrier()

    if rank == 0:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
