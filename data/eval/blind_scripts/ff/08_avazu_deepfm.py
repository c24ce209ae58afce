"""DeepFM on Avazu click logs with TorchRec model parallel embeddings.

Categorical columns are raw strings; they are mapped to contiguous ids with a
frequency-thresholded vocabulary (top `--max_vocab` values per column, id 0
is the out-of-vocabulary bucket). Last day (141030) is held out for validation.

torchrun --standalone --nproc_per_node=4 08_avazu_deepfm.py --csv /data/avazu/train.csv
"""
import argparse
import logging
import os
import time

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torchmetrics.classification import BinaryAUROC
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.distributed.comm import get_local_size
from torchrec.distributed.model_parallel import DistributedModelParallel, get_default_sharders
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.models.deepfm import SimpleDeepFMNN
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

logger = logging.getLogger("avazu")

CAT_COLS = [
    "C1", "banner_pos", "site_id", "site_domain", "site_category", "app_id", "app_domain",
    "app_category", "device_id", "device_ip", "device_model", "device_type", "device_conn_type",
    "C14", "C15", "C16", "C17", "C18", "C19", "C20", "C21",
]
VAL_DAY = "141030"


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--csv", required=True)
    ap.add_argument("--max_vocab", type=int, default=2_000_000)
    ap.add_argument("--min_count", type=int, default=5)
    ap.add_argument("--vocab_sample", type=float, default=0.2)
    ap.add_argument("--emb_dim", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=400)
    ap.add_argument("--fm_dim", type=int, default=16)
    ap.add_argument("--batch_size", type=int, default=8192)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--emb_lr", type=float, default=0.05)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--ckpt_dir", default="/shared/ckpt/avazu_deepfm")
    return ap.parse_args()


def build_vocab(df, sample_frac, max_vocab, min_count):
    sample = df.sample(frac=sample_frac)
    vocab = {}
    for c in CAT_COLS:
        counts = sample[c].value_counts()
        counts = counts[counts >= min_count].head(max_vocab)
        vocab[c] = {v: i + 1 for i, v in enumerate(counts.index)}
    return vocab


def encode(df, vocab):
    ids = np.zeros((len(df), len(CAT_COLS)), dtype=np.int64)
    for j, c in enumerate(CAT_COLS):
        ids[:, j] = df[c].map(vocab[c]).fillna(0).to_numpy(dtype=np.int64)
    hour = df["hour"].str[-2:].astype(np.float32).to_numpy() / 23.0
    dow = pd.to_datetime(df["hour"].str[:6], format="%y%m%d").dt.dayofweek.to_numpy() / 6.0
    dense = np.stack([hour, dow.astype(np.float32)], axis=1)
    return ids, dense, df["click"].to_numpy(dtype=np.float32)


class Encoded(Dataset):
    def __init__(self, ids, dense, labels):
        self.ids, self.dense, self.labels = ids, dense, labels

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.ids[i], self.dense[i], self.labels[i]


def collate(rows):
    ids = torch.from_numpy(np.stack([r[0] for r in rows]))
    b, f = ids.shape
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=CAT_COLS, values=ids.t().reshape(-1), lengths=torch.ones(b * f, dtype=torch.int32)
    )
    dense = torch.from_numpy(np.stack([r[1] for r in rows]))
    labels = torch.tensor(np.array([r[2] for r in rows]))
    return dense, kjt, labels


def build_model(args, device):
    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(name=f"t_{c}", embedding_dim=args.emb_dim,
                               num_embeddings=args.max_vocab + 1, feature_names=[c])
            for c in CAT_COLS
        ],
        device=torch.device("meta"),
    )
    net = SimpleDeepFMNN(
        num_dense_features=2,
        embedding_bag_collection=ebc,
        hidden_layer_size=args.hidden,
        deep_fm_dimension=args.fm_dim,
    )
    apply_optimizer_in_backward(torch.optim.Adagrad, net.sparse_arch.parameters(), {"lr": args.emb_lr})
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=dist.get_world_size(), local_world_size=get_local_size(),
                          compute_device="cuda"),
        batch_size=args.batch_size,
    )
    plan = planner.collective_plan(net, get_default_sharders(), dist.GroupMember.WORLD)
    model = DistributedModelParallel(net, device=device, plan=plan)
    dense_opt = KeyedOptimizerWrapper(
        dict(in_backward_optimizer_filter(model.named_parameters())),
        lambda ps: torch.optim.Adam(ps, lr=args.lr),
    )
    return model, CombinedOptimizer([model.fused_optimizer, dense_opt])


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(message)s")

    t0 = time.time()
    df = pd.read_csv(args.csv, dtype=str, usecols=["click", "hour"] + CAT_COLS)
    is_val = df["hour"].str.startswith(VAL_DAY)
    train_df, val_df = df[~is_val], df[is_val]
    vocab = build_vocab(train_df, args.vocab_sample, args.max_vocab, args.min_count)
    train_ds = Encoded(*encode(train_df, vocab))
    val_ds = Encoded(*encode(val_df, vocab))
    del df, train_df, val_df
    logger.info("data ready in %.0fs: %d train / %d val rows, vocab sizes %s", time.time() - t0,
                len(train_ds), len(val_ds), {c: len(v) for c, v in vocab.items()})

    model, optimizer = build_model(args, device)

    train_sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=collate, num_workers=4, drop_last=True, pin_memory=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size,
                            sampler=DistributedSampler(val_ds, shuffle=False, drop_last=True),
                            collate_fn=collate, num_workers=4, drop_last=True, pin_memory=True)

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for step, (dense, kjt, labels) in enumerate(train_loader):
            dense, kjt, labels = dense.to(device), kjt.to(device), labels.to(device)
            logits = model(dense, kjt).squeeze(1)
            loss = F.binary_cross_entropy_with_logits(logits, labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if step % 500 == 0:
                logger.info("epoch %d step %d/%d loss %.5f", epoch, step, len(train_loader), loss.item())

        model.eval()
        auroc = BinaryAUROC().to(device)
        val_loss = torch.zeros(2, device=device)
        with torch.no_grad():
            for dense, kjt, labels in val_loader:
                dense, kjt, labels = dense.to(device), kjt.to(device), labels.to(device)
                logits = model(dense, kjt).squeeze(1)
                val_loss[0] += F.binary_cross_entropy_with_logits(logits, labels, reduction="sum")
                val_loss[1] += labels.numel()
                auroc.update(torch.sigmoid(logits), labels.long())
        dist.all_reduce(val_loss)
        auc = auroc.compute().item()
        logger.info("epoch %d val logloss %.5f auc %.5f", epoch, (val_loss[0] / val_loss[1]).item(), auc)

        dcp.save({"model": model.state_dict(), "optim": optimizer.state_dict()},
                 checkpoint_id=os.path.join(args.ckpt_dir, f"epoch_{epoch}"))

    dist.destroy_process_group()


if __name__ == "__main__":
    main()
