"""CoNLL-2003 NER with RoBERTa, custom DDP training loop.

Usage:
    torchrun --standalone --nproc_per_node=4 02_ner_conll_roberta.py \
        --model roberta-large --out checkpoints/conll-roberta
"""
import argparse
import json
import logging
import os
import time

import torch
import torch.distributed as dist
from datasets import load_dataset
from seqeval.metrics import classification_report, f1_score, precision_score, recall_score
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import (
    AutoConfig,
    AutoModelForTokenClassification,
    AutoTokenizer,
    DataCollatorForTokenClassification,
    get_scheduler,
)

log = logging.getLogger("ner")


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="roberta-large")
    ap.add_argument("--out", required=True)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--bs", type=int, default=16, help="per-GPU batch size")
    ap.add_argument("--eval_bs", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--warmup", type=float, default=0.06)
    ap.add_argument("--max_len", type=int, default=256)
    ap.add_argument("--label_all_tokens", action="store_true")
    ap.add_argument("--resume", default=None, help="path to a training_state.pt")
    ap.add_argument("--seed", type=int, default=1234)
    return ap.parse_args()


def tokenize_and_align(batch, tokenizer, max_len, label_all_tokens):
    enc = tokenizer(
        batch["tokens"],
        is_split_into_words=True,
        truncation=True,
        max_length=max_len,
    )
    all_labels = []
    for i, tags in enumerate(batch["ner_tags"]):
        word_ids = enc.word_ids(batch_index=i)
        prev = None
        labels = []
        for w in word_ids:
            if w is None:
                labels.append(-100)
            elif w != prev:
                labels.append(tags[w])
            else:
                labels.append(tags[w] if label_all_tokens else -100)
            prev = w
        all_labels.append(labels)
    enc["labels"] = all_labels
    return enc


@torch.no_grad()
def evaluate(model, loader, id2label, device):
    model.eval()
    local = []
    loss_sum = torch.zeros(2, device=device)
    for batch in loader:
        idx = batch.pop("idx")
        batch = {k: v.to(device) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(**batch)
        loss_sum[0] += out.loss.float() * batch["labels"].size(0)
        loss_sum[1] += batch["labels"].size(0)
        pred_ids = out.logits.argmax(-1).cpu().tolist()
        gold_ids = batch["labels"].cpu().tolist()
        for i, p_row, g_row in zip(idx.tolist(), pred_ids, gold_ids):
            p_tags = [id2label[p] for p, g in zip(p_row, g_row) if g != -100]
            g_tags = [id2label[g] for g in g_row if g != -100]
            local.append((i, p_tags, g_tags))

    dist.all_reduce(loss_sum)
    # sentences have different lengths, so ship python lists instead of tensors
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    model.train()

    merged = {}
    for part in gathered:
        for i, p, g in part:
            merged[i] = (p, g)  # DistributedSampler repeats a few sentences to even out ranks
    order = sorted(merged)
    preds = [merged[i][0] for i in order]
    golds = [merged[i][1] for i in order]
    return {
        "loss": (loss_sum[0] / loss_sum[1]).item(),
        "precision": precision_score(golds, preds),
        "recall": recall_score(golds, preds),
        "f1": f1_score(golds, preds),
        "report": classification_report(golds, preds, digits=4),
    }


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    world = dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    is_main = rank == 0

    logging.basicConfig(level=logging.INFO if is_main else logging.ERROR,
                        format="[%(asctime)s] %(message)s")
    torch.manual_seed(args.seed)

    raw = load_dataset("conll2003")
    label_names = raw["train"].features["ner_tags"].feature.names
    id2label = dict(enumerate(label_names))
    label2id = {v: k for k, v in id2label.items()}

    tokenizer = AutoTokenizer.from_pretrained(args.model, add_prefix_space=True)

    # rank 0 tokenizes and fills the datasets cache, the others then read it
    if not is_main:
        dist.barrier()
    tokenized = raw.map(
        tokenize_and_align,
        batched=True,
        remove_columns=raw["train"].column_names,
        fn_kwargs=dict(tokenizer=tokenizer, max_len=args.max_len, label_all_tokens=args.label_all_tokens),
    )
    if is_main:
        dist.barrier()

    train_ds = tokenized["train"]
    dev_ds = tokenized["validation"].add_column("idx", list(range(len(tokenized["validation"]))))

    collator = DataCollatorForTokenClassification(tokenizer, pad_to_multiple_of=8)
    train_sampler = DistributedSampler(train_ds, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    dev_sampler = DistributedSampler(dev_ds, num_replicas=world, rank=rank, shuffle=False)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=train_sampler, collate_fn=collator,
                          num_workers=2, pin_memory=True, drop_last=True)
    dev_dl = DataLoader(dev_ds, batch_size=args.eval_bs, sampler=dev_sampler, collate_fn=collator, num_workers=2)

    config = AutoConfig.from_pretrained(args.model, num_labels=len(label_names),
                                        id2label=id2label, label2id=label2id)
    model = AutoModelForTokenClassification.from_pretrained(args.model, config=config)
    model.to(device)
    model = DistributedDataParallel(model, device_ids=[local_rank])

    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    num_steps = args.epochs * len(train_dl)
    sched = get_scheduler("linear", optim, num_warmup_steps=int(args.warmup * num_steps),
                          num_training_steps=num_steps)

    start_epoch, best_f1 = 0, -1.0
    if args.resume:
        state = torch.load(args.resume, map_location=device)
        model.module.load_state_dict(state["model"])
        optim.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        start_epoch, best_f1 = state["epoch"] + 1, state["best_f1"]
        log.info("resumed from %s at epoch %d", args.resume, start_epoch)

    log.info("%d GPUs x %d = global batch %d, %d steps", world, args.bs, world * args.bs, num_steps)
    os.makedirs(args.out, exist_ok=True)

    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for step, batch in enumerate(train_dl):
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optim.step()
            sched.step()
            optim.zero_grad(set_to_none=True)
            if step % 100 == 0:
                log.info("ep %d step %d/%d loss %.4f", epoch, step, len(train_dl), loss.item())

        metrics = evaluate(model, dev_dl, id2label, device)
        log.info("ep %d done in %.0fs | dev loss %.4f P %.4f R %.4f F1 %.4f", epoch, time.time() - t0,
                 metrics["loss"], metrics["precision"], metrics["recall"], metrics["f1"])

        if is_main:
            torch.save({
                "model": model.module.state_dict(),
                "optimizer": optim.state_dict(),
                "scheduler": sched.state_dict(),
                "epoch": epoch,
                "best_f1": max(best_f1, metrics["f1"]),
            }, os.path.join(args.out, "training_state.pt"))
            if metrics["f1"] > best_f1:
                model.module.save_pretrained(os.path.join(args.out, "best"))
                tokenizer.save_pretrained(os.path.join(args.out, "best"))
                with open(os.path.join(args.out, "best", "dev_report.txt"), "w") as f:
                    f.write(metrics["report"])
        best_f1 = max(best_f1, metrics["f1"])
        dist.barrier()

    if is_main:
        with open(os.path.join(args.out, "summary.json"), "w") as f:
            json.dump({"best_dev_f1": best_f1, "world_size": world}, f, indent=2)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
