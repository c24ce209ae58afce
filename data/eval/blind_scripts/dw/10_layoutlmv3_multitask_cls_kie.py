"""Joint page classification + field tagging on one LayoutLMv3 backbone.

Two label sources that never overlap: the classification set only has a doc_type per page,
the KIE set only has word tags. Batches are task-homogeneous and alternate by step, so in
every step one of the two heads gets no gradient.

    torchrun --nproc_per_node=8 10_layoutlmv3_multitask_cls_kie.py --cfg configs/mt_lmv3.json
"""
import argparse
import json
import logging
import os
import torch
import torch.distributed as dist
import torch.nn as nn
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler
from transformers import LayoutLMv3Model, LayoutLMv3Processor, get_linear_schedule_with_warmup

log = logging.getLogger("mt")

DEFAULTS = {
    "backbone": "microsoft/layoutlmv3-base",
    "cls_jsonl": "/data/docai/mt/cls_train.jsonl",
    "kie_jsonl": "/data/docai/mt/kie_train.jsonl",
    "kie_val_jsonl": "/data/docai/mt/kie_val.jsonl",
    "cache_dir": "/data/docai/mt/cache",
    "out_dir": "/data/docai/mt/runs/v1",
    "doc_types": ["invoice", "receipt", "bank_statement", "payslip", "id_card", "other"],
    "kie_tags": ["O", "B-NAME", "I-NAME", "B-DATE", "I-DATE", "B-AMOUNT", "I-AMOUNT", "B-IBAN", "I-IBAN"],
    "batch_size": 4,
    "lr": 2e-5,
    "epochs": 8,
    "steps_per_epoch": 2000,
    "max_length": 512,
}


class MultiTaskLayoutLM(nn.Module):
    def __init__(self, backbone, n_doc_types, n_tags):
        super().__init__()
        self.backbone = LayoutLMv3Model.from_pretrained(backbone)
        h = self.backbone.config.hidden_size
        self.dropout = nn.Dropout(0.1)
        self.cls_head = nn.Sequential(nn.Linear(h, h), nn.Tanh(), nn.Linear(h, n_doc_types))
        self.tok_head = nn.Linear(h, n_tags)

    def forward(self, task, input_ids, bbox, attention_mask, pixel_values):
        seq = self.backbone(input_ids=input_ids, bbox=bbox, attention_mask=attention_mask,
                            pixel_values=pixel_values).last_hidden_state
        seq = self.dropout(seq)
        if task == "cls":
            return self.cls_head(seq[:, 0])
        return self.tok_head(seq[:, : input_ids.shape[1]])


def encode_jsonl(path, processor, max_length, label_key, label_map):
    ids, boxes, masks, pixels, labels = [], [], [], [], []
    with open(path) as fh:
        for line in fh:
            r = json.loads(line)
            img = Image.open(r["image"]).convert("RGB")
            kw = {"word_labels": [label_map[t] for t in r["tags"]]} if label_key == "tags" else {}
            enc = processor(img, r["words"], boxes=r["boxes"], truncation=True, padding="max_length",
                            max_length=max_length, return_tensors="pt", **kw)
            ids.append(enc.input_ids[0]); boxes.append(enc.bbox[0]); masks.append(enc.attention_mask[0])
            pixels.append(enc.pixel_values[0].half())
            labels.append(enc.labels[0] if label_key == "tags" else torch.tensor(label_map[r["doc_type"]]))
    return [torch.stack(x) for x in (ids, boxes, masks, pixels, labels)]


def cached_tensors(name, path, processor, cfg, label_key, label_map, rank):
    cache = os.path.join(cfg["cache_dir"], f"{name}.pt")
    if rank == 0 and not os.path.exists(cache):
        os.makedirs(cfg["cache_dir"], exist_ok=True)
        tensors = encode_jsonl(path, processor, cfg["max_length"], label_key, label_map)
        torch.save(tensors, cache + ".tmp")
        os.replace(cache + ".tmp", cache)
    dist.barrier()
    return TensorDataset(*torch.load(cache))


def forever(loader):
    while True:
        yield from loader


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfg", default=None)
    cfg = dict(DEFAULTS)
    ns = ap.parse_args()
    if ns.cfg:
        with open(ns.cfg) as fh:
            cfg.update(json.load(fh))

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")

    doc2id = {d: i for i, d in enumerate(cfg["doc_types"])}
    tag2id = {t: i for i, t in enumerate(cfg["kie_tags"])}
    processor = LayoutLMv3Processor.from_pretrained(cfg["backbone"], apply_ocr=False)
    cls_ds = cached_tensors("cls_train", cfg["cls_jsonl"], processor, cfg, "doc_type", doc2id, rank)
    kie_ds = cached_tensors("kie_train", cfg["kie_jsonl"], processor, cfg, "tags", tag2id, rank)
    kie_val = cached_tensors("kie_val", cfg["kie_val_jsonl"], processor, cfg, "tags", tag2id, rank)

    samplers = {"cls": DistributedSampler(cls_ds, shuffle=True), "kie": DistributedSampler(kie_ds, shuffle=True)}
    loaders = {t: DataLoader(ds, batch_size=cfg["batch_size"], sampler=samplers[t], num_workers=4,
                             pin_memory=True, drop_last=True)
               for t, ds in (("cls", cls_ds), ("kie", kie_ds))}
    val_loader = DataLoader(Subset(kie_val, range(rank, len(kie_val), world)), batch_size=16)

    model = MultiTaskLayoutLM(cfg["backbone"], len(doc2id), len(tag2id))
    model.backbone.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.to(device)
    # one head is idle in every step (task-homogeneous batches), so DDP must look for unused params
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)

    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.01)
    total = cfg["epochs"] * cfg["steps_per_epoch"]
    scheduler = get_linear_schedule_with_warmup(optimizer, int(0.05 * total), total)
    ce = nn.CrossEntropyLoss(ignore_index=-100)

    for epoch in range(cfg["epochs"]):
        for s in samplers.values():
            s.set_epoch(epoch)
        iters = {t: forever(dl) for t, dl in loaders.items()}
        model.train()
        for step in range(cfg["steps_per_epoch"]):
            task = "cls" if step % 2 == 0 else "kie"
            ids, bbox, mask, pix, labels = (x.to(device, non_blocking=True) for x in next(iters[task]))
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(task, ids, bbox, mask, pix.float())
            loss = ce(logits.float().flatten(0, -2), labels.flatten()) if task == "kie" else ce(logits.float(), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            if rank == 0 and step % 100 == 0:
                log.info("epoch %d step %d task %s loss %.4f", epoch, step, task, loss.item())

        # token accuracy on labelled KIE positions, summed over ranks
        model.eval()
        counts = torch.zeros(2, device=device)
        with torch.no_grad():
            for ids, bbox, mask, pix, labels in val_loader:
                ids, bbox, mask, pix, labels = (x.to(device) for x in (ids, bbox, mask, pix, labels))
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    pred = model.module("kie", ids, bbox, mask, pix.float()).argmax(-1)
                keep = labels != -100
                counts[0] += (pred[keep] == labels[keep]).sum()
                counts[1] += keep.sum()
        dist.all_reduce(counts)
        if rank == 0:
            log.info("epoch %d KIE token acc %.4f", epoch, (counts[0] / counts[1]).item())
            os.makedirs(cfg["out_dir"], exist_ok=True)
            torch.save({"model": model.module.state_dict(), "cfg": cfg, "epoch": epoch},
                       os.path.join(cfg["out_dir"], f"epoch{epoch}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
