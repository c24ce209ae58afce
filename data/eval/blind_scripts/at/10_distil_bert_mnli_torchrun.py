"""
Task-specific distillation on MNLI: a fine-tuned BERT-base teacher (saved by our
own fine-tuning script as a plain torch checkpoint) distils into a 6-layer
student initialised from every other teacher layer. Loss = soft CE on logits
+ MSE on the [CLS] hidden state of mapped layers.

    torchrun --nproc_per_node=4 distil_mnli.py --teacher-ckpt /shared/ckpt/bert_base_mnli/best.pt
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import (BertConfig, BertForSequenceClassification, BertTokenizerFast,
                          DataCollatorWithPadding, get_linear_schedule_with_warmup)


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--teacher-ckpt", required=True)
    p.add_argument("--base", default="bert-base-uncased")
    p.add_argument("--student-layers", type=int, default=6)
    p.add_argument("--max-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--T", type=float, default=2.0)
    p.add_argument("--alpha", type=float, default=0.5)
    p.add_argument("--beta", type=float, default=100.0)
    p.add_argument("--output", default="/shared/ckpt/distil6_mnli")
    return p.parse_args()


def build_student_from_teacher(teacher, n_layers):
    cfg = BertConfig.from_dict(teacher.config.to_dict())
    cfg.num_hidden_layers = n_layers
    student = BertForSequenceClassification(cfg)
    t_sd = teacher.state_dict()
    s_sd = student.state_dict()
    step = teacher.config.num_hidden_layers // n_layers
    for k in s_sd:
        if ".layer." in k:
            idx = int(k.split(".layer.")[1].split(".")[0])
            src = k.replace(f".layer.{idx}.", f".layer.{idx * step}.")
            s_sd[k] = t_sd[src].clone()
        elif k in t_sd:
            s_sd[k] = t_sd[k].clone()
    student.load_state_dict(s_sd)
    return student, step


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    c = torch.zeros(2, device=device)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        labels = batch.pop("labels")
        logits = model(**batch).logits
        c[0] += (logits.argmax(-1) == labels).sum()
        c[1] += labels.numel()
    dist.all_reduce(c)
    return (c[0] / c[1]).item()


def main():
    args = get_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    tok = BertTokenizerFast.from_pretrained(args.base)
    raw = load_dataset("glue", "mnli")

    def encode(ex):
        return tok(ex["premise"], ex["hypothesis"], truncation=True, max_length=args.max_len)

    # tokenisation is cached by `datasets`; let rank 0 build the cache first
    if rank != 0:
        dist.barrier()
    data = raw.map(encode, batched=True, remove_columns=["premise", "hypothesis", "idx"])
    if rank == 0:
        dist.barrier()
    data = data.rename_column("label", "labels")
    data.set_format("torch")

    collator = DataCollatorWithPadding(tok, pad_to_multiple_of=8)
    train_sampler = DistributedSampler(data["train"], shuffle=True, seed=17)
    train_loader = DataLoader(data["train"], batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=collator, num_workers=2, drop_last=True)
    val_loaders = {
        split: DataLoader(data[split], batch_size=128, collate_fn=collator,
                          sampler=DistributedSampler(data[split], shuffle=False))
        for split in ("validation_matched", "validation_mismatched")
    }

    teacher = BertForSequenceClassification.from_pretrained(args.base, num_labels=3)
    ckpt = torch.load(args.teacher_ckpt)
    teacher.load_state_dict(ckpt["model_state_dict"])
    teacher.to(device).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)

    student, layer_step = build_student_from_teacher(teacher, args.student_layers)
    student.to(device)
    student = DDP(student, device_ids=[local_rank])

    no_decay = ("bias", "LayerNorm.weight")
    groups = [
        {"params": [p for n, p in student.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": 0.01},
        {"params": [p for n, p in student.named_parameters() if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.lr)
    total_steps = len(train_loader) * args.epochs
    scheduler = get_linear_schedule_with_warmup(optimizer, int(0.1 * total_steps), total_steps)

    if rank == 0:
        os.makedirs(args.output, exist_ok=True)
        print(f"teacher acc(m) from ckpt: {ckpt.get('val_acc', 'n/a')} | student layers {args.student_layers}")

    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        student.train()
        t0 = time.time()
        for step, batch in enumerate(train_loader):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            labels = batch.pop("labels")
            with torch.no_grad():
                t_out = teacher(**batch, output_hidden_states=True)
            s_out = student(**batch, output_hidden_states=True)

            soft = F.kl_div(F.log_softmax(s_out.logits / args.T, -1), F.softmax(t_out.logits / args.T, -1),
                            reduction="batchmean") * args.T ** 2
            hard = F.cross_entropy(s_out.logits, labels)
            cls_mse = sum(
                F.mse_loss(s_out.hidden_states[i][:, 0], t_out.hidden_states[i * layer_step][:, 0])
                for i in range(1, args.student_layers + 1)
            ) / args.student_layers
            loss = args.alpha * soft + (1 - args.alpha) * hard + args.beta * cls_mse

            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            if rank == 0 and step % 200 == 0:
                print(f"ep {epoch} step {step}/{len(train_loader)} soft {soft.item():.4f} "
                      f"hard {hard.item():.4f} cls {cls_mse.item():.5f}", flush=True)

        accs = {k: evaluate(student, v, device) for k, v in val_loaders.items()}
        if rank == 0:
            print(f"epoch {epoch} ({time.time() - t0:.0f}s) m {accs['validation_matched']:.4f} "
                  f"mm {accs['validation_mismatched']:.4f}", flush=True)
            if accs["validation_matched"] > best:
                best = accs["validation_matched"]
                student.module.save_pretrained(args.output)
                tok.save_pretrained(args.output)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
