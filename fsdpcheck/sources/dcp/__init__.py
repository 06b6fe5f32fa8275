"""DCP checkpoints: the restricted ``.metadata`` machine and what is built on it.

``vm``        the restricted pickle machine alone: opcodes, a memo never sized by the file, the
              allowlist of DCP's classes (the same kind of code as torch's weights-only
              unpickler); it imports nothing of the rest and is handed its plugin
``runs``      the plugin: runs of chunks and storage entries read as columns, however
              ``pickle.dump`` wrote DCP's classes
``stream``    the ``.metadata`` reader that drives the machine with the plugin
``metadata``  the mirrors of DCP's metadata classes and the object path
``index``     ``DcpIndex``, the one structural checker of both paths
``source``    the ``Source`` of a local DCP folder (raw reads of its chunks)
``remote``    the same for a folder in object storage
``load``      the safe storage reader and load planner handed to ``dcp.load``
"""
