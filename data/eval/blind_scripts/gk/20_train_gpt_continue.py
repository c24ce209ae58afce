"""
Speedrun-style GPT trainer that can continue a run from a saved state file.

    torchrun --standalone --nproc_per_node=8 train_gpt.py
    torchrun --standalone --nproc_per_node=8 train_gpt.py --init_from logs/<run_id>/state_step002000.pt --num_iterations 4000
"""
import argparse
import glob
import os
import time
import uuid

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP


def norm(x):
    return F.rms_norm(x, (x.size(-1),))


class CastedLinear(nn.Linear):
    def __init__(self, in_features, out_features):
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x):
        return F.linear(x, self.weight.type_as(x))


class Rotary(nn.Module):
    def __init__(self, dim, max_seq_len):
        super().__init__()
        freq = (1 / 1024) ** torch.linspace(0, 1, steps=dim // 4, dtype=torch.float32)
        freq = torch.cat([freq, freq.new_zeros(dim // 4)])
        theta = torch.einsum("i,j -> ij", torch.arange(max_seq_len, dtype=torch.float32), freq)
        self.register_buffer("cos", theta.cos(), persistent=False)
        self.register_buffer("sin", theta.sin(), persistent=False)

    def forward(self, x_BTHD):
        cos, sin = self.cos[None, :x_BTHD.size(-3), None, :], self.sin[None, :x_BTHD.size(-3), None, :]
        x1, x2 = x_BTHD.to(dtype=torch.float32).chunk(2, dim=-1)
        return torch.cat((x1 * cos + x2 * sin, x1 * (-sin) + x2 * cos), 3).type_as(x_BTHD)


class CausalSelfAttention(nn.Module):
    def __init__(self, dim, num_heads, max_seq_len):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.c_qkv = CastedLinear(dim, 3 * dim)
        self.c_proj = CastedLinear(dim, dim)
        self.c_proj.weight.detach().zero_()
        self.rotary = Rotary(self.head_dim, max_seq_len)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_qkv(x).view(B, T, 3 * self.num_heads, self.head_dim).chunk(3, dim=-2)
        q, k = self.rotary(norm(q)), self.rotary(norm(k))
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=0.12)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MLP(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.c_fc = CastedLinear(dim, 4 * dim)
        self.c_proj = CastedLinear(4 * dim, dim)
        self.c_proj.weight.detach().zero_()

    def forward(self, x):
        return self.c_proj(F.relu(self.c_fc(x)).square())


class Block(nn.Module):
    def __init__(self, dim, num_heads, max_seq_len):
        super().__init__()
        self.attn = CausalSelfAttention(dim, num_heads, max_seq_len)
        self.mlp = MLP(dim)

    def forward(self, x):
        x = x + self.attn(norm(x))
        return x + self.mlp(norm(x))


class GPT(nn.Module):
    def __init__(self, vocab_size, num_layers, num_heads, model_dim, max_seq_len):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, model_dim)
        self.blocks = nn.ModuleList([Block(model_dim, num_heads, max_seq_len) for _ in range(num_layers)])
        self.lm_head = CastedLinear(model_dim, vocab_size)
        self.lm_head.weight.detach().zero_()

    def forward(self, idx, targets):
        x = norm(self.embed(idx))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(norm(x)).float()
        logits = 30 * torch.sigmoid(logits / 7.5)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


@torch.compile
def zeropower_via_newtonschulz5(G, steps=5):
    a, b, c = (3.4445, -4.7750, 2.0315)
    X = G.bfloat16()
    if G.size(-2) > G.size(-1):
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    if G.size(-2) > G.size(-1):
        X = X.mT
    return X


class Muon(torch.optim.Optimizer):
    def __init__(self, params, lr=0.05, momentum=0.95, nesterov=True):
        super().__init__(params, dict(lr=lr, momentum=momentum, nesterov=nesterov))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - group["momentum"])
                g = p.grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
                p.add_(zeropower_via_newtonschulz5(g).type_as(p), alpha=-group["lr"] * max(1, p.size(-2) / p.size(-1)) ** 0.5)


def _load_data_shard(path):
    header = np.fromfile(path, dtype=np.int32, count=256)
    assert header[0] == 20240520, "magic number mismatch in the data .bin file"
    assert header[1] == 1, "unsupported version"
    return np.memmap(path, dtype=np.uint16, mode="r", offset=256 * 4, shape=(int(header[2]),))


class DistributedDataLoader:
    def __init__(self, pattern, B, T, rank, world_size):
        self.files = sorted(glob.glob(pattern))
        assert self.files, f"no files match {pattern}"
        self.B, self.T, self.rank, self.world_size = B, T, rank, world_size
        self.seek(0, 0)

    def seek(self, shard, pos):
        self.shard, self.pos = shard, pos
        self.tokens = _load_data_shard(self.files[shard])

    def next_batch(self):
        n = self.B * self.T
        if self.pos + n * self.world_size + 1 > len(self.tokens):
            self.seek((self.shard + 1) % len(self.files), 0)
        start = self.pos + self.rank * n
        buf = torch.from_numpy(self.tokens[start: start + n + 1].astype(np.int64)).pin_memory()
        self.pos += n * self.world_size
        buf = buf.cuda(non_blocking=True)
        return buf[:-1].view(self.B, self.T), buf[1:].view(self.B, self.T)


parser = argparse.ArgumentParser()
parser.add_argument("--train_files", default="data/fineweb10B/fineweb_train_*.bin")
parser.add_argument("--val_files", default="data/fineweb10B/fineweb_val_*.bin")
parser.add_argument("--init_from", default=None)
parser.add_argument("--batch_size", type=int, default=64)
parser.add_argument("--seq_len", type=int, default=1024)
parser.add_argument("--num_iterations", type=int, default=2000)
parser.add_argument("--cooldown_frac", type=float, default=0.4)
parser.add_argument("--val_loss_every", type=int, default=125)
parser.add_argument("--val_tokens", type=int, default=10485760)
parser.add_argument("--save_every", type=int, default=500)
args = parser.parse_args()

rank = int(os.environ["RANK"])
world_size = int(os.environ["WORLD_SIZE"])
local_rank = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local_rank)
dist.init_process_group(backend="nccl")
master_process = rank == 0

run_id = str(uuid.uuid4()) if master_process else None
obj = [run_id]
dist.broadcast_object_list(obj, src=0)
run_id = obj[0]
log_dir = f"logs/{run_id}"


def print0(s):
    if master_process:
        print(s)
        with open(f"{log_dir}/log.txt", "a") as f:
            print(s, file=f)


if master_process:
    os.makedirs(log_dir, exist_ok=True)

model = GPT(vocab_size=50304, num_layers=12, num_heads=6, model_dim=768, max_seq_len=args.seq_len).cuda()
for m in model.modules():
    if isinstance(m, nn.Embedding):
        m.bfloat16()
hidden_params = [p for p in model.blocks.parameters() if p.ndim >= 2]
adam = torch.optim.Adam([dict(params=[model.embed.weight], lr=0.6), dict(params=[model.lm_head.weight], lr=0.008)],
                        betas=(0.8, 0.95), eps=1e-10, fused=True)
muon = Muon(hidden_params, lr=0.05, momentum=0.95)
optimizers = [adam, muon]
for opt in optimizers:
    for group in opt.param_groups:
        group["initial_lr"] = group["lr"]

train_loader = DistributedDataLoader(args.train_files, args.batch_size, args.seq_len, rank, world_size)
start_step = 0
if args.init_from is not None:
    checkpoint = torch.load(args.init_from)
    model.load_state_dict(checkpoint["model"])
    for opt, opt_state in zip(optimizers, checkpoint["optimizers"]):
        opt.load_state_dict(opt_state)
    train_loader.seek(*checkpoint["loader"])
    start_step = checkpoint["step"]
    del checkpoint
    print0(f"continuing from {args.init_from} at step {start_step}")

model = DDP(torch.compile(model), device_ids=[local_rank])


def get_lr(step):
    x = step / args.num_iterations
    if x < 1 - args.cooldown_frac:
        return 1.0
    return max((1 - x) / args.cooldown_frac, 0.0)


val_steps = args.val_tokens // (args.batch_size * args.seq_len * world_size)
training_time_ms = 0.0
torch.cuda.synchronize()
t0 = time.perf_counter()
for step in range(start_step, args.num_iterations + 1):
    last_step = step == args.num_iterations

    if last_step or step % args.val_loss_every == 0:
        torch.cuda.synchronize()
        training_time_ms += 1000 * (time.perf_counter() - t0)
        model.eval()
        val_loader = DistributedDataLoader(args.val_files, args.batch_size, args.seq_len, rank, world_size)
        val_loss = torch.zeros((), device="cuda")
        with torch.no_grad():
            for _ in range(val_steps):
                x, y = val_loader.next_batch()
                val_loss += model(x, y)
        val_loss /= val_steps
        dist.all_reduce(val_loss, op=dist.ReduceOp.AVG)
        print0(f"step:{step}/{args.num_iterations} val_loss:{val_loss.item():.4f} train_time:{training_time_ms:.0f}ms")
        model.train()
        torch.cuda.synchronize()
        t0 = time.perf_counter()

    if master_process and step > start_step and (last_step or step % args.save_every == 0):
        state = dict(step=step, model=model.module._orig_mod.state_dict(),
                     optimizers=[opt.state_dict() for opt in optimizers],
                     loader=(train_loader.shard, train_loader.pos))
        torch.save(state, f"{log_dir}/state_step{step:06d}.pt")
    if last_step:
        break

    inputs, targets = train_loader.next_batch()
    model(inputs, targets).backward()
    for opt in optimizers:
        for group in opt.param_groups:
            group["lr"] = group["initial_lr"] * get_lr(step)
    for group in muon.param_groups:
        group["momentum"] = (1 - min(step / 300, 1)) * 0.85 + min(step / 300, 1) * 0.95
    for opt in optimizers:
        opt.step()
    model.zero_grad(set_to_none=True)
    approx = training_time_ms + 1000 * (time.perf_counter() - t0)
    print0(f"step:{step + 1}/{args.num_iterations} train_time:{approx:.0f}ms step_avg:{approx / (step + 1 - start_step):.2f}ms")

print0(f"peak memory allocated: {torch.cuda.max_memory_allocated() // 1024 // 1024} MiB")
dist.destroy_process_group()
