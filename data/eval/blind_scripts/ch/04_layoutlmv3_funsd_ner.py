"""LayoutLMv3 token classification (semantic entity labelling) on FUNSD.

torchrun --standalone --nproc_per_node=4 04_layoutlmv3_funsd_ner.py --output_dir runs/lmv3_funsd
"""
import argparse
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import wandb
from datasets import load_dataset
from seqeval.metrics import classification_report, f1_score, precision_score, recall_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoProcessor, LayoutLMv3ForTokenClassification, get_linear_schedule_with_warmup


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model_name", default="microsoft/layoutlmv3-base")
    ap.add_argument("--dataset", default="nielsr/funsd-layoutlmv3")
    ap.add_argument("--output_dir", default="runs/lmv3_funsd")
    ap.add_argument("--cache_dir", default=".hf_cache")
    ap.add_argument("--batch_size", type=int, default=2)
    ap.add_argument("--max_steps", type=int, default=1000)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--warmup_steps", type=int, default=100)
    ap.add_argument("--eval_steps", type=int, default=100)
    ap.add_argument("--grad_ckpt", action="store_true")
    ap.add_argument("--resume", default=None)
    ap.add_argument("--wandb_project", default="doc-ner")
    return ap.parse_args()


def encode_split(ds, processor, label_list):
    features = ds.features
    num_proc = 8

    def prepare(examples):
        enc = processor(examples["image"], examples["tokens"], boxes=examples["bboxes"],
                        word_labels=examples["ner_tags"], truncation=True, padding="max_length",
                        max_length=512)
        return enc

    return ds.map(prepare, batched=True, remove_columns=list(features.keys()), num_proc=num_proc)


def collate(batch):
    out = {}
    for k in ("input_ids", "attention_mask", "bbox", "labels"):
        out[k] = torch.tensor([b[k] for b in batch])
    out["pixel_values"] = torch.tensor(np.stack([np.asarray(b["pixel_values"]) for b in batch]))
    return out


@torch.no_grad()
def evaluate(model, loader, id2label, device, world_size):
    model.eval()
    true_seqs, pred_seqs = [], []
    for batch in loader:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
        preds = logits.argmax(-1).cpu().numpy()
        labels = batch["labels"].cpu().numpy()
        for p_row, l_row in zip(preds, labels):
            keep = l_row != -100
            true_seqs.append([id2label[int(l)] for l in l_row[keep]])
            pred_seqs.append([id2label[int(p)] for p in p_row[keep]])
    model.train()

    # shards are disjoint and unpadded, so concatenating them gives the exact val set
    gathered = [None] * world_size
    dist.all_gather_object(gathered, (true_seqs, pred_seqs))
    all_true = [s for t, _ in gathered for s in t]
    all_pred = [s for _, p in gathered for s in p]
    return {
        "precision": precision_score(all_true, all_pred),
        "recall": recall_score(all_true, all_pred),
        "f1": f1_score(all_true, all_pred),
        "n_docs": len(all_true),
    }, classification_report(all_true, all_pred, digits=4)


def main():
    args = get_args()
    dist.init_process_group("nccl")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    is_main = rank == 0

    raw = load_dataset(args.dataset, cache_dir=args.cache_dir)
    label_list = raw["train"].features["ner_tags"].feature.names
    id2label = dict(enumerate(label_list))
    label2id = {v: k for k, v in id2label.items()}
    processor = AutoProcessor.from_pretrained(args.model_name, apply_ocr=False)

    # rank 0 tokenises and fills the datasets cache first; the others then hit the finished cache
    if not is_main:
        dist.barrier()
    train_ds = encode_split(raw["train"], processor, label_list)
    test_ds = encode_split(raw["test"], processor, label_list)
    if is_main:
        dist.barrier()

    model = LayoutLMv3ForTokenClassification.from_pretrained(
        args.model_name, id2label=id2label, label2id=label2id)
    if args.grad_ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.to(device)
    model = DDP(model, device_ids=[local_rank], output_device=local_rank)

    train_sampler = DistributedSampler(train_ds, shuffle=True, seed=0)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=collate, num_workers=4, pin_memory=True, drop_last=True)
    test_loader = DataLoader(Subset(test_ds, list(range(rank, len(test_ds), world_size))),
                             batch_size=8, collate_fn=collate, num_workers=4)

    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = get_linear_schedule_with_warmup(optimizer, args.warmup_steps, args.max_steps)

    step, best_f1, epoch = 0, 0.0, 0
    if args.resume:
        state = torch.load(args.resume, map_location="cpu")
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        step, best_f1, epoch = state["step"], state["best_f1"], state["epoch"]

    if is_main:
        os.makedirs(args.output_dir, exist_ok=True)
        wandb.init(project=args.wandb_project, config=vars(args), name=os.path.basename(args.output_dir))

    model.train()
    t0 = time.time()
    while step < args.max_steps:
        train_sampler.set_epoch(epoch)
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            if is_main and step % 20 == 0:
                wandb.log({"train/loss": loss.item(), "lr": scheduler.get_last_lr()[0]}, step=step)

            if step % args.eval_steps == 0 or step == args.max_steps:
                metrics, report = evaluate(model, test_loader, id2label, device, world_size)
                if is_main:
                    print(f"step {step} ({time.time() - t0:.0f}s) {metrics}\n{report}", flush=True)
                    wandb.log({f"eval/{k}": v for k, v in metrics.items()}, step=step)
                    if metrics["f1"] > best_f1:
                        best_f1 = metrics["f1"]
                        model.module.save_pretrained(os.path.join(args.output_dir, "best"))
                        processor.save_pretrained(os.path.join(args.output_dir, "best"))
                    torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                                "scheduler": scheduler.state_dict(), "step": step, "epoch": epoch,
                                "best_f1": best_f1}, os.path.join(args.output_dir, "last.pt"))
            if step >= args.max_steps:
                break
        epoch += 1

    if is_main:
        wandb.finish()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
