#!/usr/bin/env python
"""Fine-tune a 20B decoder on math solutions with an 8-stage DeepSpeed pipeline over two nodes.

Only the first stage (token ids) and the last stage (labels) read data; the
middle stages get no iterator. Training stops early once validation loss has
not improved for --patience evaluations.

    deepspeed --hostfile /fsx/hostfile --num_nodes 2 --num_gpus 8 17_pipe_math_earlystop.py \
        --ds-config configs/pp8_bf16.json --stages 8 --data /fsx/data/math_sft --save /fsx/exp/math20b
"""
import argparse
import json
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
import deepspeed
import deepspeed.comm as dist
from datasets import load_from_disk
from deepspeed.pipe import LayerSpec, PipelineModule
from deepspeed.utils import RepeatingLoader
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

PAD, IGN = 0, -100


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--ds-config", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--save", required=True)
    p.add_argument("--init", default=None, help="pipeline checkpoint of the base model")
    p.add_argument("--stages", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--vocab", type=int, default=50432)
    p.add_argument("--hidden", type=int, default=6144)
    p.add_argument("--layers", type=int, default=44)
    p.add_argument("--heads", type=int, default=64)
    p.add_argument("--max-steps", type=int, default=6000)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--patience", type=int, default=5)
    p.add_argument("--local_rank", type=int, default=-1)
    return p.parse_args()


class Embedding(nn.Module):
    def __init__(self, vocab, hidden):
        super().__init__()
        self.embed_in = nn.Embedding(vocab, hidden)

    def forward(self, ids):
        return self.embed_in(ids)


class NeoXLayer(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.heads = heads
        self.input_layernorm = nn.LayerNorm(hidden)
        self.post_attention_layernorm = nn.LayerNorm(hidden)
        self.query_key_value = nn.Linear(hidden, 3 * hidden)
        self.dense = nn.Linear(hidden, hidden)
        self.dense_h_to_4h = nn.Linear(hidden, 4 * hidden)
        self.dense_4h_to_h = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.query_key_value(self.input_layernorm(x)).view(B, T, self.heads, 3, -1).permute(3, 0, 2, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        mlp = self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(self.post_attention_layernorm(x))))
        return x + self.dense(attn) + mlp


class Unembed(nn.Module):
    def __init__(self, hidden, vocab):
        super().__init__()
        self.final_layer_norm = nn.LayerNorm(hidden)
        self.embed_out = nn.Linear(hidden, vocab, bias=False)

    def forward(self, x):
        return self.embed_out(self.final_layer_norm(x))


class EpochLoader:
    """Endless iterator over a DataLoader that reshuffles its DistributedSampler on each pass."""

    def __init__(self, loader, sampler):
        self.loader, self.sampler, self.epoch = loader, sampler, 0
        self.sampler.set_epoch(self.epoch)
        self.it = iter(self.loader)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self.it)
        except StopIteration:
            self.epoch += 1
            self.sampler.set_epoch(self.epoch)
            self.it = iter(self.loader)
            return next(self.it)


def masked_lm_loss(logits, labels):
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), labels.view(-1), ignore_index=IGN)


def collate(rows, seq):
    ids = torch.full((len(rows), seq), PAD, dtype=torch.long)
    lab = torch.full((len(rows), seq), IGN, dtype=torch.long)
    for i, r in enumerate(rows):
        x = r["input_ids"][:seq + 1]
        m = r["loss_mask"][:seq + 1]
        n = len(x) - 1
        ids[i, :n] = torch.tensor(x[:-1])
        tgt = torch.tensor(x[1:])
        tgt[torch.tensor(m[1:]) == 0] = IGN
        lab[i, :n] = tgt
    return ids, lab


def main():
    args = get_args()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    deepspeed.init_distributed()
    torch.manual_seed(0)

    specs = [LayerSpec(Embedding, args.vocab, args.hidden)]
    specs += [LayerSpec(NeoXLayer, args.hidden, args.heads) for _ in range(args.layers)]
    specs += [LayerSpec(Unembed, args.hidden, args.vocab)]
    model = PipelineModule(layers=specs, num_stages=args.stages, loss_fn=masked_lm_loss,
                           partition_method="type:NeoXLayer", activation_checkpoint_interval=1,
                           checkpointable_layers=["NeoXLayer"])

    with open(args.ds_config) as f:
        ds_config = json.load(f)
    dp = model.mpu().get_data_parallel_world_size()
    mbs, gas = ds_config["train_micro_batch_size_per_gpu"], ds_config["gradient_accumulation_steps"]
    ds_config["train_batch_size"] = mbs * gas * dp

    engine, _, _, _ = deepspeed.initialize(model=model, config=ds_config,
                                           model_parameters=[p for p in model.parameters() if p.requires_grad])
    if args.init:
        engine.load_checkpoint(args.init, load_module_only=True, load_optimizer_states=False,
                               load_lr_scheduler_states=False)

    needs_data = engine.is_first_stage() or engine.is_last_stage()
    train_iter = val_loader = sampler = None
    if needs_data:
        data = load_from_disk(args.data)
        dp_rank = engine.grid.get_data_parallel_rank()
        sampler = DistributedSampler(data["train"], num_replicas=dp, rank=dp_rank, shuffle=True, seed=0)
        train_loader = DataLoader(data["train"], batch_size=mbs, sampler=sampler, drop_last=True,
                                  num_workers=2, collate_fn=lambda r: collate(r, args.seq))
        val_loader = DataLoader(data["validation"], batch_size=mbs, drop_last=True, num_workers=2,
                                sampler=DistributedSampler(data["validation"], num_replicas=dp, rank=dp_rank,
                                                           shuffle=False, drop_last=True),
                                collate_fn=lambda r: collate(r, args.seq))
        train_iter = EpochLoader(train_loader, sampler)

    writer = SummaryWriter(os.path.join(args.save, "tb")) if engine.global_rank == 0 else None
    best, bad_evals = math.inf, 0
    step = engine.global_steps

    while step < args.max_steps:
        loss = engine.train_batch(data_iter=train_iter)
        step = engine.global_steps
        if writer and step % 10 == 0:
            writer.add_scalar("train/loss", loss.item(), step)
            writer.add_scalar("train/lr", engine.get_lr()[0], step)

        if step % args.eval_every == 0:
            n_eval = 16
            val_iter = iter(RepeatingLoader(val_loader)) if needs_data else None
            # eval_batch broadcasts the mean loss from the last stage, so every rank
            # sees the same value and takes the same early-stopping decision
            vloss = sum(engine.eval_batch(val_iter).item() for _ in range(n_eval)) / n_eval
            if writer:
                writer.add_scalar("val/loss", vloss, step)
                print(f"step {step} train {loss.item():.4f} val {vloss:.4f} best {best:.4f}", flush=True)
            if vloss < best:
                best, bad_evals = vloss, 0
                engine.save_checkpoint(args.save, tag="best", client_state={"val_loss": vloss})
            else:
                bad_evals += 1
                if bad_evals >= args.patience:
                    if writer:
                        print(f"early stop at step {step}", flush=True)
                    break

    engine.save_checkpoint(args.save, tag=f"last_step{step}", client_state={"val_loss": best})
    if writer:
        writer.close()
    dist.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
