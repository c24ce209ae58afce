"""Token-level layout role labelling on DocBank (title, author, abstract, section, caption, ...)
with LayoutLMv3. Metrics go to Weights & Biases.

    WANDB_PROJECT=docbank torchrun --nproc_per_node=8 19_layoutlmv3_docbank_wandb.py --docbank /data/DocBank
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
import wandb
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoProcessor, LayoutLMv3ForTokenClassification, get_linear_schedule_with_warmup

ROLES = ["paragraph", "title", "author", "abstract", "section", "caption", "equation", "figure",
         "footer", "list", "reference", "table", "date"]
R2I = {r: i for i, r in enumerate(ROLES)}


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--docbank", required=True, help="has txt/, img/ and {train,dev}.list")
    ap.add_argument("--model", default="microsoft/layoutlmv3-base")
    ap.add_argument("--run_name", default=None)
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--eval_steps", type=int, default=5000)
    ap.add_argument("--save_dir", default="ckpt/docbank_lmv3")
    return ap.parse_args()


class DocBank(Dataset):
    def __init__(self, root, split, processor):
        self.root, self.processor = root, processor
        with open(os.path.join(root, f"{split}.list")) as f:
            self.stems = [l.strip() for l in f if l.strip()]

    def __len__(self):
        return len(self.stems)

    def __getitem__(self, i):
        stem = self.stems[i]
        words, boxes, labels = [], [], []
        with open(os.path.join(self.root, "txt", stem + ".txt"), encoding="utf-8") as f:
            for line in f:
                parts = line.rstrip("\n").split("\t")
                if len(parts) != 10 or not parts[0].strip():
                    continue
                x0, y0, x1, y1 = (min(1000, max(0, int(v))) for v in parts[1:5])
                words.append(parts[0])
                boxes.append([x0, y0, max(x0, x1), max(y0, y1)])
                labels.append(R2I[parts[9]])
        image = Image.open(os.path.join(self.root, "img", stem + "_ori.jpg")).convert("RGB")
        enc = self.processor(image, words, boxes=boxes, word_labels=labels, truncation=True,
                             padding="max_length", max_length=512, return_tensors="pt")
        return {k: v[0] for k, v in enc.items()}


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    conf = torch.zeros(len(ROLES), len(ROLES), dtype=torch.long, device=device)
    for batch in loader:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        pred = model(**batch).logits.argmax(-1)
        keep = batch["labels"] != -100
        conf += torch.bincount(batch["labels"][keep] * len(ROLES) + pred[keep],
                               minlength=len(ROLES) ** 2).view(len(ROLES), len(ROLES))
    dist.all_reduce(conf)
    model.train()
    tp = conf.diag().float()
    prec = tp / conf.sum(0).clamp(min=1)
    rec = tp / conf.sum(1).clamp(min=1)
    f1 = 2 * prec * rec / (prec + rec).clamp(min=1e-8)
    return {f"f1/{r}": f1[i].item() for i, r in enumerate(ROLES)} | {"f1/macro": f1.mean().item()}


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    wandb.init(project=os.environ.get("WANDB_PROJECT", "docbank"), name=args.run_name,
               config={**vars(args), "world_size": world})

    processor = AutoProcessor.from_pretrained(args.model, apply_ocr=False)
    train_ds = DocBank(args.docbank, "train", processor)
    dev_ds = DocBank(args.docbank, "dev", processor)
    sampler = DistributedSampler(train_ds, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, num_workers=8,
                              pin_memory=True, drop_last=True)
    dev_loader = DataLoader(dev_ds, batch_size=32, sampler=DistributedSampler(dev_ds, shuffle=False), num_workers=8)

    model = LayoutLMv3ForTokenClassification.from_pretrained(
        args.model, num_labels=len(ROLES), id2label=dict(enumerate(ROLES)), label2id=R2I
    ).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = args.epochs * len(train_loader)
    scheduler = get_linear_schedule_with_warmup(optimizer, int(0.05 * total), total)

    step, best = 0, 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for batch in train_loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            step += 1
            if step % 50 == 0:
                wandb.log({"train/loss": loss.item(), "train/grad_norm": grad_norm.item(),
                           "train/lr": scheduler.get_last_lr()[0],
                           "train/pages_per_s": 50 * args.batch_size * world / (time.time() - t0)}, step=step)
                t0 = time.time()
            if step % args.eval_steps == 0 or step == total:
                metrics = evaluate(model, dev_loader, device)
                if rank == 0:
                    wandb.log(metrics, step=step)
                    print(f"step {step}: macro F1 {metrics['f1/macro']:.4f}", flush=True)
                    if metrics["f1/macro"] > best:
                        best = metrics["f1/macro"]
                        model.module.save_pretrained(args.save_dir)
                        processor.save_pretrained(args.save_dir)
                dist.barrier()

    if rank == 0:
        wandb.summary["best_macro_f1"] = best
    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
