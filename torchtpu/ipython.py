"""IPython extension: `%load_ext torchtpu`.

%tpu_mode [debug|strict|fused]  switch the eager mode (no argument: print it)
%tpu_metrics                    show torchtpu.metrics.report() (an HTML table
                                in Jupyter)
"""


def load_ipython_extension(ip):
    from . import errors, metrics, modes

    errors.install_ipython_handler(ip)

    def tpu_mode(line):
        name = line.strip()
        if not name:
            print(modes.get_eager_mode())
            return
        try:
            modes.set_eager_mode(name.lower())
        except ValueError as e:
            from IPython.core.error import UsageError
            raise UsageError(str(e)) from None
        print(f"torchtpu eager mode: {modes.get_eager_mode()}")

    def tpu_metrics(line):
        return metrics.report()

    ip.register_magic_function(tpu_mode, "line", "tpu_mode")
    ip.register_magic_function(tpu_metrics, "line", "tpu_metrics")


def unload_ipython_extension(ip):
    pass
