"""Multilingual intent classification with a top-2 MoE encoder (DeepSpeed MoE, ZeRO-1, fp16).

    deepspeed --num_gpus 8 13_moe_intent_classifier.py --deepspeed --deepspeed_config configs/moe_cls.json \
        --data /shared/data/massive_tok --num-labels 60 --experts 16 --ep-size 4 \
        --save /shared/exp/moe_intent
"""
import argparse
import logging
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
import deepspeed
import torch.distributed as dist
from datasets import load_from_disk
from deepspeed.moe.layer import MoE
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger(__name__)


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--save", required=True)
    ap.add_argument("--num-labels", type=int, default=60)
    ap.add_argument("--vocab", type=int, default=250002)
    ap.add_argument("--max-len", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--ep-size", type=int, default=4)
    ap.add_argument("--aux-coef", type=float, default=0.01)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--local_rank", type=int, default=-1)
    ap = deepspeed.add_config_arguments(ap)
    return ap.parse_args()


class Expert(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(h, 4 * h), nn.GELU(), nn.Dropout(0.1), nn.Linear(4 * h, h))

    def forward(self, x):
        return self.net(x)


class Layer(nn.Module):
    def __init__(self, args, use_moe):
        super().__init__()
        self.attn = nn.MultiheadAttention(args.hidden, args.heads, dropout=0.1, batch_first=True)
        self.n1 = nn.LayerNorm(args.hidden)
        self.n2 = nn.LayerNorm(args.hidden)
        self.use_moe = use_moe
        if use_moe:
            self.ff = MoE(hidden_size=args.hidden, expert=Expert(args.hidden), num_experts=args.experts,
                          ep_size=args.ep_size, k=2, capacity_factor=1.5, eval_capacity_factor=2.0,
                          min_capacity=4, use_residual=False)
        else:
            self.ff = Expert(args.hidden)

    def forward(self, x, pad):
        a, _ = self.attn(x, x, x, key_padding_mask=pad, need_weights=False)
        x = self.n1(x + a)
        if self.use_moe:
            f, aux, _ = self.ff(x)
        else:
            f, aux = self.ff(x), x.new_zeros(())
        return self.n2(x + f), aux


class MoEClassifier(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.emb = nn.Embedding(args.vocab, args.hidden, padding_idx=1)
        self.pos = nn.Embedding(args.max_len, args.hidden)
        self.layers = nn.ModuleList([Layer(args, use_moe=(i % 2 == 1)) for i in range(args.layers)])
        self.pool = nn.Linear(args.hidden, args.hidden)
        self.cls = nn.Linear(args.hidden, args.num_labels)

    def forward(self, input_ids, attention_mask):
        x = self.emb(input_ids) + self.pos(torch.arange(input_ids.size(1), device=input_ids.device))
        pad = attention_mask == 0
        aux = x.new_zeros(())
        for layer in self.layers:
            x, a = layer(x, pad)
            aux = aux + a
        return self.cls(torch.tanh(self.pool(x[:, 0]))), aux


@torch.no_grad()
def evaluate(engine, loader):
    engine.eval()
    correct, total, loss_sum = 0, 0, 0.0
    for batch in loader:
        ids = batch["input_ids"].to(engine.device)
        mask = batch["attention_mask"].to(engine.device)
        y = batch["label"].to(engine.device)
        logits, _ = engine(ids, mask)
        loss_sum += F.cross_entropy(logits.float(), y, reduction="sum").item()
        correct += (logits.argmax(-1) == y).sum().item()
        total += y.numel()
    stats = torch.tensor([loss_sum, correct, total], dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.SUM)
    engine.train()
    return stats[0].item() / stats[2].item(), stats[1].item() / stats[2].item()


def main():
    args = get_args()
    logging.basicConfig(level=logging.INFO)
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(17)

    data = load_from_disk(args.data)
    data.set_format("torch", columns=["input_ids", "attention_mask", "label"])
    train_ds, val_ds = data["train"], data["validation"]

    model = MoEClassifier(args)
    groups = split_params_into_different_moe_groups_for_optimizer(
        [{"params": [p for n, p in model.named_parameters() if "bias" not in n and "n1" not in n and "n2" not in n],
          "name": "wd", "weight_decay": 0.01},
         {"params": [p for n, p in model.named_parameters() if "bias" in n or "n1" in n or "n2" in n],
          "name": "no_wd", "weight_decay": 0.0}])
    engine, _, _, _ = deepspeed.initialize(args=args, model=model, model_parameters=groups)

    mbs = engine.train_micro_batch_size_per_gpu()
    tr_sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=17)
    train_loader = DataLoader(train_ds, batch_size=mbs, sampler=tr_sampler, drop_last=True, num_workers=4)
    val_loader = DataLoader(val_ds, batch_size=64,
                            sampler=DistributedSampler(val_ds, num_replicas=world, rank=rank, shuffle=False,
                                                       drop_last=True),
                            num_workers=2)

    best_acc = -1.0
    for epoch in range(args.epochs):
        tr_sampler.set_epoch(epoch)
        for step, batch in enumerate(train_loader):
            ids = batch["input_ids"].to(engine.device, non_blocking=True)
            mask = batch["attention_mask"].to(engine.device, non_blocking=True)
            y = batch["label"].to(engine.device, non_blocking=True)
            logits, aux = engine(ids, mask)
            loss = F.cross_entropy(logits.float(), y) + args.aux_coef * aux
            engine.backward(loss)
            engine.step()
            if rank == 0 and step % 100 == 0:
                log.info("epoch %d step %d loss %.4f aux %.4f", epoch, step, loss.item(), aux.item())

        val_loss, val_acc = evaluate(engine, val_loader)
        if rank == 0:
            log.info("epoch %d val_loss %.4f val_acc %.4f", epoch, val_loss, val_acc)
        engine.save_checkpoint(args.save, tag=f"epoch{epoch}", client_state={"val_acc": val_acc})
        if val_acc > best_acc:
            best_acc = val_acc
            engine.save_checkpoint(args.save, tag="best", client_state={"val_acc": val_acc})

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
