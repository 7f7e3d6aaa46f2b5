"""Small models the capture and compile tests train against CPU."""
import torch
import torch.nn.functional as F


# No parameter whose gradient is zero in exact arithmetic (a bias before batch
# norm, attention's key bias): Adam's update of such a parameter is the sign
# of rounding noise times lr, different on any two backends.
class CNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(2, 4, 3, padding=1, bias=False)
        self.norm = torch.nn.BatchNorm2d(4)
        self.head = torch.nn.Linear(4 * 3 * 3, 3)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.norm(self.conv(x))), 2)
        return self.head(x.flatten(1))


class Transformer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True,
                                                      bias=False)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.layer(x).mean(1))


# model, the shape of a batch
