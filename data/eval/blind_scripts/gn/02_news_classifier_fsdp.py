"""Fine-tune a transformer encoder for news topic classification with FSDP.

Evaluates every --eval-steps optimizer steps, keeps the best full checkpoint by
validation macro-F1, reduces LR on plateau and stops early.

    torchrun --nproc_per_node=8 02_news_classifier_fsdp.py --model roberta-large
"""
import argparse
import functools
import math
import os
import time

import torch
import torch.distributed as dist
from datasets import load_dataset
from torch.distributed.fsdp import (
    FullStateDictConfig,
    FullyShardedDataParallel as FSDP,
    MixedPrecision,
    ShardingStrategy,
    StateDictType,
)
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, Sampler
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding
from transformers.models.roberta.modeling_roberta import RobertaLayer


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="roberta-large")
    ap.add_argument("--dataset", default="ag_news")
    ap.add_argument("--output-dir", default="checkpoints/agnews")
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--eval-steps", type=int, default=500)
    ap.add_argument("--patience", type=int, default=4)
    ap.add_argument("--min-delta", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=17)
    return ap.parse_args()


class EvalShardSampler(Sampler):
    """Strided shard, padded to the same length on every rank so that every rank runs
    the same number of FSDP forwards; the first `num_real` indices are the real ones."""

    def __init__(self, n, rank, world):
        self.idx = list(range(rank, n, world))
        self.num_real = len(self.idx)
        self.idx += self.idx[-1:] * (math.ceil(n / world) - self.num_real)

    def __iter__(self):
        return iter(self.idx)

    def __len__(self):
        return len(self.idx)


def print0(*a):
    if dist.get_rank() == 0:
        print(*a, flush=True)


@torch.no_grad()
def macro_f1(model, loader, num_labels, device):
    """Confusion matrix summed over ranks -> macro F1 and mean loss (identical on every rank)."""
    model.eval()
    conf = torch.zeros(num_labels, num_labels, dtype=torch.float64, device=device)
    loss_sum = torch.zeros(2, dtype=torch.float64, device=device)
    num_real, seen = loader.sampler.num_real, 0
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        labels = batch.pop("labels")
        logits = model(**batch).logits.float()
        keep = (torch.arange(labels.numel(), device=device) + seen) < num_real
        seen += labels.numel()
        labels, logits = labels[keep], logits[keep]
        preds = logits.argmax(-1)
        loss_sum[0] += torch.nn.functional.cross_entropy(logits, labels, reduction="sum").double()
        loss_sum[1] += labels.numel()
        conf.index_put_((labels, preds), torch.ones_like(preds, dtype=torch.float64), accumulate=True)
    dist.all_reduce(conf)
    dist.all_reduce(loss_sum)
    tp = conf.diag()
    precision = tp / conf.sum(0).clamp(min=1)
    recall = tp / conf.sum(1).clamp(min=1)
    f1 = 2 * precision * recall / (precision + recall).clamp(min=1e-12)
    model.train()
    return f1.mean().item(), (loss_sum[0] / loss_sum[1]).item()


def save_full(model, path):
    cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
        state = model.state_dict()
    if dist.get_rank() == 0:
        torch.save(state, path + ".part")
        os.replace(path + ".part", path)
    dist.barrier()


def load_full(model, path):
    state = torch.load(path, map_location="cpu")
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        model.load_state_dict(state)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.model)

    def encode(ex):
        return tok(ex["text"], truncation=True, max_length=args.max_len)

    def prepare():
        raw = load_dataset(args.dataset)
        # fixed-seed split, same on every rank
        split = raw["train"].train_test_split(test_size=0.05, seed=args.seed)
        parts = [split["train"], split["test"], raw["test"]]
        parts = [d.map(encode, batched=True, remove_columns=["text"]).rename_column("label", "labels")
                 for d in parts]
        return parts, raw["train"].features["label"].num_classes

    # rank 0 downloads and builds the Arrow caches first, the others then load them
    if rank == 0:
        prepare()
    dist.barrier()
    (train_ds, val_ds, test_ds), num_labels = prepare()

    collate = DataCollatorWithPadding(tok, pad_to_multiple_of=8)
    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.micro_batch, sampler=train_sampler, collate_fn=collate,
                          num_workers=4, pin_memory=True)
    val_dl = DataLoader(val_ds, batch_size=64, sampler=EvalShardSampler(len(val_ds), rank, world),
                        collate_fn=collate, num_workers=4)
    test_dl = DataLoader(test_ds, batch_size=64, sampler=EvalShardSampler(len(test_ds), rank, world),
                         collate_fn=collate, num_workers=4)

    model = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=num_labels)
    wrap = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={RobertaLayer})
    model = FSDP(
        model,
        auto_wrap_policy=wrap,
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
                                       buffer_dtype=torch.bfloat16),
        device_id=local_rank,
        use_orig_params=True,
    )

    # global batch = micro_batch * world; lr tuned for 8 x 16
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr * (args.micro_batch * world) / 128,
                              weight_decay=0.01)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optim, mode="max", factor=0.5, patience=1)

    os.makedirs(args.output_dir, exist_ok=True)
    best_path = os.path.join(args.output_dir, "best_full.pt")
    best_f1, evals_without_gain, step = -math.inf, 0, 0
    stop = False
    t0 = time.time()

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for batch in train_dl:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            loss = model(**batch).loss
            loss.backward()
            model.clip_grad_norm_(1.0)
            optim.step()
            optim.zero_grad(set_to_none=True)
            step += 1

            if step % 50 == 0:
                print0(f"ep {epoch} step {step} loss {loss.item():.4f} "
                       f"lr {optim.param_groups[0]['lr']:.2e} {time.time() - t0:.0f}s")

            if step % args.eval_steps == 0:
                f1, val_loss = macro_f1(model, val_dl, num_labels, device)
                plateau.step(f1)
                print0(f"[eval] step {step} macro-F1 {f1:.4f} val-loss {val_loss:.4f}")
                if f1 > best_f1 + args.min_delta:
                    best_f1, evals_without_gain = f1, 0
                    save_full(model, best_path)
                    print0(f"[eval] new best, wrote {best_path}")
                else:
                    evals_without_gain += 1
                # f1 is all-reduced, so every rank takes the same branch
                if evals_without_gain >= args.patience:
                    print0(f"[eval] early stop at step {step}")
                    stop = True
                    break
        if stop:
            break

    load_full(model, best_path)
    test_f1, test_loss = macro_f1(model, test_dl, num_labels, device)
    print0(f"[test] best checkpoint (val F1 {best_f1:.4f}): test macro-F1 {test_f1:.4f} loss {test_loss:.4f}")

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
