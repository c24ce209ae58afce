"""
Trains a character-level GPT on some text file, minGPT style (config objects + Trainer class),
extended to DDP.

torchrun --standalone --nproc_per_node=4 16_mingpt_chargpt.py --trainer.max_iters=20000
"""
import math
import os
import sys
import time
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class CfgNode:
    """ a lightweight configuration class inspired by yacs """

    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)

    def merge_from_args(self, args):
        for arg in args:
            assert arg.startswith('--'), f"expecting --key=value, got {arg}"
            key, val = arg[2:].split('=')
            *path, leaf = key.split('.')
            obj = self
            for k in path:
                obj = getattr(obj, k)
            old = getattr(obj, leaf)
            setattr(obj, leaf, type(old)(val))

    def to_dict(self):
        return {k: v.to_dict() if isinstance(v, CfgNode) else v for k, v in self.__dict__.items()}


def get_config():
    C = CfgNode()
    C.system = CfgNode(seed=3407, work_dir='./out/chargpt', input_file='input.txt')
    C.data = CfgNode(block_size=128)
    C.model = CfgNode(n_layer=6, n_head=6, n_embd=192, embd_pdrop=0.1, resid_pdrop=0.1, attn_pdrop=0.1)
    C.trainer = CfgNode(max_iters=10000, batch_size=64, learning_rate=5e-4, betas=(0.9, 0.95),
                        weight_decay=0.1, grad_norm_clip=1.0, num_workers=4, log_every=100,
                        save_every=1000)
    return C


class CharDataset(Dataset):
    def __init__(self, config, data):
        chars = sorted(list(set(data)))
        self.stoi = {ch: i for i, ch in enumerate(chars)}
        self.itos = {i: ch for i, ch in enumerate(chars)}
        self.vocab_size = len(chars)
        self.block_size = config.block_size
        self.data = data

    def __len__(self):
        return len(self.data) - self.block_size

    def __getitem__(self, idx):
        chunk = self.data[idx:idx + self.block_size + 1]
        dix = [self.stoi[s] for s in chunk]
        x = torch.tensor(dix[:-1], dtype=torch.long)
        y = torch.tensor(dix[1:], dtype=torch.long)
        return x, y


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.ln_1 = nn.LayerNorm(c.n_embd)
        self.attn = nn.MultiheadAttention(c.n_embd, c.n_head, dropout=c.attn_pdrop, batch_first=True)
        self.ln_2 = nn.LayerNorm(c.n_embd)
        self.mlp = nn.Sequential(nn.Linear(c.n_embd, 4 * c.n_embd), nn.GELU(),
                                 nn.Linear(4 * c.n_embd, c.n_embd), nn.Dropout(c.resid_pdrop))

    def forward(self, x, mask):
        h = self.ln_1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.block_size = c.block_size
        self.tok_emb = nn.Embedding(c.vocab_size, c.n_embd)
        self.pos_emb = nn.Parameter(torch.zeros(1, c.block_size, c.n_embd))
        self.drop = nn.Dropout(c.embd_pdrop)
        self.blocks = nn.ModuleList([Block(c) for _ in range(c.n_layer)])
        self.ln_f = nn.LayerNorm(c.n_embd)
        self.head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        n_params = sum(p.numel() for p in self.parameters())
        print("number of parameters: %.2fM" % (n_params / 1e6,))

    def forward(self, idx, targets=None):
        t = idx.size(1)
        mask = torch.triu(torch.ones(t, t, device=idx.device, dtype=torch.bool), diagonal=1)
        x = self.drop(self.tok_emb(idx) + self.pos_emb[:, :t])
        for blk in self.blocks:
            x = blk(x, mask)
        logits = self.head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


class Trainer:
    def __init__(self, config, model, train_dataset, rank, local_rank, world_size):
        self.config = config
        self.rank, self.local_rank, self.world_size = rank, local_rank, world_size
        self.device = torch.device('cuda', local_rank)
        self.model = DDP(model.to(self.device), device_ids=[local_rank])
        self.train_dataset = train_dataset
        self.callbacks = defaultdict(list)
        self.iter_num = 0
        self.loss_history = []

    def add_callback(self, onevent, callback):
        self.callbacks[onevent].append(callback)

    def trigger_callbacks(self, onevent):
        for callback in self.callbacks.get(onevent, []):
            callback(self)

    def run(self):
        config = self.config
        optimizer = torch.optim.AdamW(self.model.parameters(), lr=config.learning_rate,
                                      betas=config.betas, weight_decay=config.weight_decay)
        sampler = DistributedSampler(self.train_dataset, shuffle=True)
        loader = DataLoader(self.train_dataset, sampler=sampler, batch_size=config.batch_size,
                            num_workers=config.num_workers, pin_memory=True, drop_last=True)
        epoch = 0
        sampler.set_epoch(epoch)
        data_iter = iter(loader)
        self.model.train()
        self.iter_time = time.time()
        while True:
            try:
                x, y = next(data_iter)
            except StopIteration:
                epoch += 1
                sampler.set_epoch(epoch)
                data_iter = iter(loader)
                x, y = next(data_iter)
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

            logits, self.loss = self.model(x, y)
            self.model.zero_grad(set_to_none=True)
            self.loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), config.grad_norm_clip)
            optimizer.step()
            self.loss_history.append(self.loss.item())

            self.trigger_callbacks('on_batch_end')
            self.iter_num += 1
            tnow = time.time()
            self.iter_dt = tnow - self.iter_time
            self.iter_time = tnow
            if self.iter_num >= config.max_iters:
                break


def main():
    config = get_config()
    config.merge_from_args(sys.argv[1:])

    local_rank = int(os.environ['LOCAL_RANK'])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend='nccl')
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(config.system.seed)
    if rank == 0:
        os.makedirs(config.system.work_dir, exist_ok=True)

    text = open(config.system.input_file, 'r').read()
    train_dataset = CharDataset(config.data, text)
    config.model.vocab_size = train_dataset.vocab_size
    config.model.block_size = train_dataset.block_size
    model = GPT(config.model)
    trainer = Trainer(config.trainer, model, train_dataset, rank, local_rank, world_size)

    def batch_end_callback(trainer):
        if trainer.iter_num % config.trainer.log_every == 0:
            # average of the recent losses over all ranks
            recent = trainer.loss_history[-config.trainer.log_every:]
            avg_loss = torch.tensor(sum(recent) / len(recent))
            dist.all_reduce(avg_loss, op=dist.ReduceOp.SUM)
            avg_loss /= trainer.world_size
            if trainer.rank == 0:
                print(f"iter_dt {trainer.iter_dt * 1000:.2f}ms; iter {trainer.iter_num}: "
                      f"train loss {avg_loss.item():.5f}")

        if trainer.iter_num % config.trainer.save_every == 0 and trainer.rank == 0:
            ckpt_path = os.path.join(config.system.work_dir, "model.pt")
            torch.save(trainer.model.module.state_dict(), ckpt_path)

    trainer.add_callback('on_batch_end', batch_end_callback)
    trainer.run()
    dist.destroy_process_group()


if __name__ == '__main__':
    main()
