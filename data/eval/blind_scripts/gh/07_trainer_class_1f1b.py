"""3D-parallel LM trainer (PP x FSDP2 x TP) on torch-native APIs.

    torchrun --nnodes 4 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint $MASTER:29500 \
        trainer_3d.py --pp 4 --tp 2 --run-name mistral3b-base
"""
import argparse
import logging
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader, Dataset, DistributedSampler

logger = logging.getLogger(__name__)

MODEL = dict(dim=3072, n_layers=28, n_heads=24, ffn=8192, vocab=32768)


class DecoderBlock(nn.Module):
    def __init__(self, dim, n_heads, ffn):
        super().__init__()
        self.head_dim = dim // n_heads
        self.ln1, self.ln2 = nn.RMSNorm(dim, eps=1e-6), nn.RMSNorm(dim, eps=1e-6)
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)
        self.gate_proj = nn.Linear(dim, ffn, bias=False)
        self.up_proj = nn.Linear(dim, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, dim, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        h = self.ln1(x)
        q = self.q_proj(h).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.k_proj(h).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.v_proj(h).view(b, s, -1, self.head_dim).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(a.transpose(1, 2).reshape(b, s, -1))
        h = self.ln2(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class PipelinePart(nn.Module):
    def __init__(self, layer_ids, first, last, dim, n_heads, ffn, vocab, **_):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim) if first else None
        self.layers = nn.ModuleDict({str(i): DecoderBlock(dim, n_heads, ffn) for i in layer_ids})
        self.norm = nn.RMSNorm(dim, eps=1e-6) if last else None
        self.lm_head = nn.Linear(dim, vocab, bias=False) if last else None

    def forward(self, x):
        if self.embed_tokens is not None:
            x = self.embed_tokens(x)
        for blk in self.layers.values():
            x = blk(x)
        if self.lm_head is not None:
            x = self.lm_head(self.norm(x))
        return x


class ShardedTokens(Dataset):
    def __init__(self, path, seq_len):
        self.data = np.memmap(path, dtype=np.uint16, mode="r")
        self.seq_len = seq_len

    def __len__(self):
        return (len(self.data) - 1) // self.seq_len

    def __getitem__(self, idx):
        a = idx * self.seq_len
        chunk = torch.from_numpy(self.data[a:a + self.seq_len + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]


class Trainer:
    def __init__(self, args):
        self.args = args
        self.local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(self.local_rank)
        self.device = torch.device("cuda", self.local_rank)
        world = int(os.environ["WORLD_SIZE"])
        self.dp = world // (args.pp * args.tp)
        self.mesh = init_device_mesh("cuda", (args.pp, self.dp, args.tp), mesh_dim_names=("pp", "dp", "tp"))
        self.rank = dist.get_rank()
        self.pp_rank = self.mesh["pp"].get_local_rank()
        self.dp_rank = self.mesh["dp"].get_local_rank()
        self.tp_rank = self.mesh["tp"].get_local_rank()
        self.dp_group = self.mesh["dp"].get_group()
        self.is_first = self.pp_rank == 0
        self.is_last = self.pp_rank == args.pp - 1
        self.step = 0
        logging.basicConfig(level=logging.INFO,
                            format=f"[%(asctime)s r{self.rank} pp{self.pp_rank}] %(message)s")
        self._build_model()
        self._build_data()

    def _build_model(self):
        a = self.args
        n = MODEL["n_layers"] // a.pp
        with torch.device("meta"):
            self.model = PipelinePart(range(self.pp_rank * n, (self.pp_rank + 1) * n),
                                      self.is_first, self.is_last, **MODEL)
        tp_mesh = self.mesh["tp"]
        if self.is_first:
            parallelize_module(self.model.embed_tokens, tp_mesh, RowwiseParallel(input_layouts=Replicate()))
        if self.is_last:
            parallelize_module(self.model.lm_head, tp_mesh, ColwiseParallel(output_layouts=Replicate()))
        for blk in self.model.layers.values():
            parallelize_module(blk, tp_mesh, {
                "q_proj": ColwiseParallel(), "k_proj": ColwiseParallel(), "v_proj": ColwiseParallel(),
                "o_proj": RowwiseParallel(), "gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(),
                "down_proj": RowwiseParallel(),
            })
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for blk in self.model.layers.values():
            fully_shard(blk, mesh=self.mesh["dp"], mp_policy=mp, reshard_after_forward=False)
        fully_shard(self.model, mesh=self.mesh["dp"], mp_policy=mp, reshard_after_forward=False)
        torch.manual_seed(a.seed)
        self.model.to_empty(device=self.device)
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if "ln" in name or name.startswith("norm"):
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, 0.02)

        self.stage = PipelineStage(self.model, self.pp_rank, a.pp, self.device,
                                   group=self.mesh["pp"].get_group())
        self.schedule = Schedule1F1B(self.stage, n_microbatches=a.microbatches, loss_fn=self.loss_fn)
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1)
        self.lr_sched = torch.optim.lr_scheduler.OneCycleLR(
            self.optim, max_lr=a.lr, total_steps=a.steps, pct_start=a.warmup / a.steps,
            anneal_strategy="cos", div_factor=100.0, final_div_factor=10.0)

    @staticmethod
    def loss_fn(logits, labels):
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), ignore_index=-100)

    def _build_data(self):
        a = self.args
        train = ShardedTokens(os.path.join(a.data, "train.bin"), a.seq_len)
        val = ShardedTokens(os.path.join(a.data, "val.bin"), a.seq_len)
        self.train_sampler = DistributedSampler(train, num_replicas=self.dp, rank=self.dp_rank,
                                                shuffle=True, seed=a.seed, drop_last=True)
        self.train_loader = DataLoader(train, batch_size=a.batch_size, sampler=self.train_sampler,
                                       num_workers=4, pin_memory=True, drop_last=True)
        val_sampler = DistributedSampler(val, num_replicas=self.dp, rank=self.dp_rank, shuffle=False)
        self.val_loader = DataLoader(val, batch_size=a.batch_size, sampler=val_sampler,
                                     num_workers=2, pin_memory=True, drop_last=True)

    def _pipeline(self, run, x, y):
        losses = [] if self.is_last else None
        target = y.to(self.device, non_blocking=True) if self.is_last else None
        if self.is_first:
            run(x.to(self.device, non_blocking=True), target=target, losses=losses)
        else:
            run(target=target, losses=losses)
        return torch.stack(losses).mean().detach() if self.is_last else None

    def ckpt_state(self):
        m, o = get_state_dict(self.model, self.optim)
        return {"model": m, "optim": o, "lr_sched": self.lr_sched.state_dict(), "step": self.step}

    def save(self):
        path = os.path.join(self.args.ckpt_dir, self.args.run_name, f"step-{self.step}")
        dcp.save(self.ckpt_state(), checkpoint_id=path)
        logger.info("saved %s", path)

    def maybe_resume(self):
        root = os.path.join(self.args.ckpt_dir, self.args.run_name)
        if not os.path.isdir(root):
            return
        steps = [int(d.split("-")[1]) for d in os.listdir(root)
                 if d.startswith("step-") and os.path.exists(os.path.join(root, d, ".metadata"))]
        if not steps:
            return
        sd = self.ckpt_state()
        dcp.load(sd, checkpoint_id=os.path.join(root, f"step-{max(steps)}"))
        set_state_dict(self.model, self.optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        self.lr_sched.load_state_dict(sd["lr_sched"])
        self.step = sd["step"]
        logger.info("resumed at step %d", self.step)

    @torch.no_grad()
    def evaluate(self):
        self.model.eval()
        losses = []
        for i, (x, y) in enumerate(self.val_loader):
            if i >= self.args.eval_batches:
                break
            loss = self._pipeline(self.schedule.eval, x, y)
            if self.is_last:
                losses.append(loss)
        self.model.train()
        if self.is_last:
            val_loss = torch.stack(losses).mean()
            dist.all_reduce(val_loss, op=dist.ReduceOp.AVG)
            if self.dp_rank == 0 and self.tp_rank == 0:
                logger.info("step %d | val loss %.4f | val ppl %.2f", self.step, val_loss.item(),
                            math.exp(val_loss.item()))

    def train(self):
        a = self.args
        self.maybe_resume()
        epoch = self.step // len(self.train_loader)
        self.train_sampler.set_epoch(epoch)
        data = iter(self.train_loader)
        t0 = time.time()
        while self.step < a.steps:
            try:
                x, y = next(data)
            except StopIteration:
                epoch += 1
                self.train_sampler.set_epoch(epoch)
                data = iter(self.train_loader)
                x, y = next(data)
            self.optim.zero_grad(set_to_none=True)
            loss = self._pipeline(self.schedule.step, x, y)
            self.optim.step()
            self.lr_sched.step()
            self.step += 1

            if self.step % a.log_every == 0 and self.is_last:
                dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=self.dp_group)
                if self.dp_rank == 0 and self.tp_rank == 0:
                    dt = (time.time() - t0) / a.log_every
                    logger.info("step %d | loss %.4f | lr %.2e | %.2f s/it", self.step, loss.item(),
                                self.lr_sched.get_last_lr()[0], dt)
                t0 = time.time()
            if self.step % a.eval_every == 0:
                self.evaluate()
            if self.step % a.save_every == 0:
                self.save()
        self.save()
        dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/datasets/tok/mix_v3")
    ap.add_argument("--ckpt-dir", default="/checkpoints")
    ap.add_argument("--run-name", default="debug")
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--eval-batches", type=int, default=25)
    ap.add_argument("--save-every", type=int, default=2500)
    ap.add_argument("--seed", type=int, default=1)
    Trainer(ap.parse_args()).train()


if __name__ == "__main__":
    main()
