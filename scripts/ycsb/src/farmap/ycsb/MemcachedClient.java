package farmap.ycsb;

import java.io.BufferedInputStream;
import java.io.BufferedOutputStream;
import java.io.ByteArrayOutputStream;
import java.io.EOFException;
import java.io.IOException;
import java.io.InputStream;
import java.io.OutputStream;
import java.net.InetSocketAddress;
import java.net.Socket;
import java.nio.ByteBuffer;
import java.nio.charset.StandardCharsets;
import java.util.HashMap;
import java.util.LinkedHashMap;
import java.util.Map;
import java.util.Properties;
import java.util.Set;
import java.util.Vector;

import site.ycsb.ByteArrayByteIterator;
import site.ycsb.ByteIterator;
import site.ycsb.DB;
import site.ycsb.DBException;
import site.ycsb.Status;

/**
 * YCSB binding for memcached (farmap's own): the text protocol over one plain socket per
 * instance (YCSB makes one instance per client thread), no dependency.
 *
 * <p>A record is one item whose value encodes all its fields: a 4-byte big-endian field count,
 * then for each field its name's length (4 bytes), the name (UTF-8), its value's length
 * (4 bytes) and the value's bytes; so any bytes round-trip. read = get (+ decode; the fields
 * asked for, or all), insert = set, update = set when the update writes every field
 * ({@code fieldcount} of them, e.g. writeallfields=true), otherwise gets + cas of the merged
 * record (read-modify-write, retried when another client wrote in between), delete = delete,
 * scan = NOT_IMPLEMENTED. Any reply other than the protocol's expected one is an ERROR, and
 * the connection is then reopened for the next operation (its stream may be out of step).
 *
 * <p>Properties: {@code memcached.host} (127.0.0.1), {@code memcached.port} (11211),
 * {@code memcached.timeout} (connect and read timeout in ms, 10000).
 */
public class MemcachedClient extends DB {
  private static final int MAX_KEY = 250;
  private static final int CAS_TRIES = 100;

  private String host;
  private int port;
  private int timeout;
  private int fieldCount;
  private Socket socket;
  private InputStream in;
  private OutputStream out;

  /** An answer that does not follow the protocol (or a server error): the op is an ERROR. */
  private static final class ProtocolException extends IOException {
    private static final long serialVersionUID = 1L;

    ProtocolException(String message) {
      super(message);
    }
  }

  /** One item as get/gets returned it. */
  private static final class Item {
    final byte[] value;
    final long cas;

    Item(byte[] value, long cas) {
      this.value = value;
      this.cas = cas;
    }
  }

  @Override
  public void init() throws DBException {
    Properties p = getProperties();
    host = p.getProperty("memcached.host", "127.0.0.1");
    try {
      port = Integer.parseInt(p.getProperty("memcached.port", "11211"));
      timeout = Integer.parseInt(p.getProperty("memcached.timeout", "10000"));
      fieldCount = Integer.parseInt(p.getProperty("fieldcount", "10"));
    } catch (NumberFormatException e) {
      throw new DBException("memcached.port, memcached.timeout and fieldcount must be integers: " + e.getMessage());
    }
    try {
      connect();
      send(bytes("version\r\n"));
      String v = readLine();
      if (!v.startsWith("VERSION ")) {
        throw new DBException("memcached at " + host + ":" + port + " answered version with " + v);
      }
    } catch (IOException e) {
      throw new DBException("cannot talk to memcached at " + host + ":" + port + ": " + e.getMessage(), e);
    }
  }

  @Override
  public void cleanup() throws DBException {
    disconnect();
  }

  private void connect() throws IOException {
    Socket s = new Socket();
    try {
      s.setTcpNoDelay(true);
      s.setSoTimeout(timeout);
      s.connect(new InetSocketAddress(host, port), timeout);
      in = new BufferedInputStream(s.getInputStream(), 1 << 16);
      out = new BufferedOutputStream(s.getOutputStream(), 1 << 16);
      socket = s;
    } catch (IOException e) {
      s.close();
      throw e;
    }
  }

  private void disconnect() {
    if (socket != null) {
      try {
        socket.close();
      } catch (IOException e) {
        // Closing: nothing to do.
      }
    }
    socket = null;
    in = null;
    out = null;
  }

  private static byte[] bytes(String s) {
    return s.getBytes(StandardCharsets.UTF_8);
  }

  private static void checkKey(String key) throws ProtocolException {
    byte[] k = bytes(key);
    if (k.length == 0 || k.length > MAX_KEY) {
      throw new ProtocolException("key length " + k.length);
    }
    for (byte b : k) {
      if (b <= 32 || b == 127) {
        throw new ProtocolException("key has a space or control byte");
      }
    }
  }

  private void send(byte[]... parts) throws IOException {
    if (socket == null) {
      connect();
    }
    for (byte[] part : parts) {
      out.write(part);
    }
    out.flush();
  }

  /** One reply line without its CRLF (ASCII); a bare LF or a missing CRLF is an error. */
  private String readLine() throws IOException {
    StringBuilder sb = new StringBuilder(64);
    while (true) {
      int b = in.read();
      if (b < 0) {
        throw new EOFException("memcached closed the connection");
      }
      if (b == '\r') {
        if (in.read() != '\n') {
          throw new ProtocolException("CR without LF in a reply line");
        }
        return sb.toString();
      }
      if (b == '\n' || sb.length() > 1024) {
        throw new ProtocolException("malformed reply line: " + sb);
      }
      sb.append((char) b);
    }
  }

  private byte[] readExactly(int n) throws IOException {
    byte[] buf = new byte[n];
    int off = 0;
    while (off < n) {
      int r = in.read(buf, off, n - off);
      if (r < 0) {
        throw new EOFException("memcached closed the connection in a value");
      }
      off += r;
    }
    return buf;
  }

  /** get (or gets, with cas) of one key: null when it is absent. */
  private Item get(String key, boolean withCas) throws IOException {
    checkKey(key);
    send(bytes((withCas ? "gets " : "get ") + key + "\r\n"));
    String line = readLine();
    if (line.equals("END")) {
      return null;
    }
    String[] w = line.split(" ", -1);
    if (w.length != (withCas ? 5 : 4) || !w[0].equals("VALUE") || !w[1].equals(key)) {
      throw new ProtocolException("unexpected reply to get: " + line);
    }
    int n;
    long cas = 0;
    try {
      Long.parseUnsignedLong(w[2]);
      n = Integer.parseInt(w[3]);
      if (withCas) {
        cas = Long.parseUnsignedLong(w[4]);
      }
    } catch (NumberFormatException e) {
      throw new ProtocolException("unexpected reply to get: " + line);
    }
    if (n < 0) {
      throw new ProtocolException("negative value length: " + line);
    }
    byte[] value = readExactly(n);
    if (in.read() != '\r' || in.read() != '\n') {
      throw new ProtocolException("value of " + key + " not followed by CRLF");
    }
    String end = readLine();
    if (!end.equals("END")) {
      throw new ProtocolException("get of one key not ended by END: " + end);
    }
    return new Item(value, cas);
  }

  /** set/add/cas of one item: the server's one-line answer. */
  private String store(String verb, String key, byte[] value, String casSuffix) throws IOException {
    checkKey(key);
    send(bytes(verb + " " + key + " 0 0 " + value.length + casSuffix + "\r\n"), value, bytes("\r\n"));
    return readLine();
  }

  private static byte[] encode(Map<String, byte[]> fields) {
    ByteArrayOutputStream b = new ByteArrayOutputStream(64 + fields.size() * 128);
    ByteBuffer n = ByteBuffer.allocate(4);
    n.putInt(0, fields.size());
    b.write(n.array(), 0, 4);
    for (Map.Entry<String, byte[]> e : fields.entrySet()) {
      byte[] name = bytes(e.getKey());
      n.putInt(0, name.length);
      b.write(n.array(), 0, 4);
      b.write(name, 0, name.length);
      n.putInt(0, e.getValue().length);
      b.write(n.array(), 0, 4);
      b.write(e.getValue(), 0, e.getValue().length);
    }
    return b.toByteArray();
  }

  private static Map<String, byte[]> decode(byte[] value) throws ProtocolException {
    ByteBuffer b = ByteBuffer.wrap(value);
    try {
      int count = b.getInt();
      if (count < 0) {
        throw new ProtocolException("negative field count in a stored record");
      }
      Map<String, byte[]> fields = new LinkedHashMap<>(count * 2);
      for (int i = 0; i < count; i++) {
        byte[] name = new byte[b.getInt()];
        b.get(name);
        byte[] v = new byte[b.getInt()];
        b.get(v);
        fields.put(new String(name, StandardCharsets.UTF_8), v);
      }
      if (b.hasRemaining()) {
        throw new ProtocolException("trailing bytes after a stored record");
      }
      return fields;
    } catch (RuntimeException e) {
      // BufferUnderflowException, NegativeArraySizeException: not a record of ours.
      throw new ProtocolException("malformed stored record: " + e);
    }
  }

  private static Map<String, byte[]> arrays(Map<String, ByteIterator> values) {
    Map<String, byte[]> m = new LinkedHashMap<>(values.size() * 2);
    for (Map.Entry<String, ByteIterator> e : values.entrySet()) {
      m.put(e.getKey(), e.getValue().toArray());
    }
    return m;
  }

  /** The status of an operation that failed with an I/O or protocol error; reconnects next time. */
  private Status failed(IOException e) {
    disconnect();
    return Status.ERROR;
  }

  @Override
  public Status read(String table, String key, Set<String> fields, Map<String, ByteIterator> result) {
    try {
      Item item = get(key, false);
      if (item == null) {
        return Status.NOT_FOUND;
      }
      Map<String, byte[]> record = decode(item.value);
      if (fields == null) {
        for (Map.Entry<String, byte[]> e : record.entrySet()) {
          result.put(e.getKey(), new ByteArrayByteIterator(e.getValue()));
        }
      } else {
        for (String f : fields) {
          byte[] v = record.get(f);
          if (v != null) {
            result.put(f, new ByteArrayByteIterator(v));
          }
        }
      }
      return Status.OK;
    } catch (IOException e) {
      return failed(e);
    }
  }

  @Override
  public Status insert(String table, String key, Map<String, ByteIterator> values) {
    try {
      String reply = store("set", key, encode(arrays(values)), "");
      if (!reply.equals("STORED")) {
        throw new ProtocolException("unexpected reply to set: " + reply);
      }
      return Status.OK;
    } catch (IOException e) {
      return failed(e);
    }
  }

  @Override
  public Status update(String table, String key, Map<String, ByteIterator> values) {
    try {
      Map<String, byte[]> given = arrays(values);
      if (given.size() >= fieldCount) {
        // Every field is written: no need to read the old record.
        String reply = store("set", key, encode(given), "");
        if (!reply.equals("STORED")) {
          throw new ProtocolException("unexpected reply to set: " + reply);
        }
        return Status.OK;
      }
      for (int i = 0; i < CAS_TRIES; i++) {
        Item item = get(key, true);
        if (item == null) {
          return Status.NOT_FOUND;
        }
        Map<String, byte[]> record = decode(item.value);
        record.putAll(given);
        String reply = store("cas", key, encode(record), " " + Long.toUnsignedString(item.cas));
        switch (reply) {
          case "STORED":
            return Status.OK;
          case "EXISTS":
            continue; // Another client wrote it since our gets: merge again.
          case "NOT_FOUND":
            return Status.NOT_FOUND;
          default:
            throw new ProtocolException("unexpected reply to cas: " + reply);
        }
      }
      return Status.ERROR;
    } catch (IOException e) {
      return failed(e);
    }
  }

  @Override
  public Status delete(String table, String key) {
    try {
      checkKey(key);
      send(bytes("delete " + key + "\r\n"));
      String reply = readLine();
      switch (reply) {
        case "DELETED":
          return Status.OK;
        case "NOT_FOUND":
          return Status.NOT_FOUND;
        default:
          throw new ProtocolException("unexpected reply to delete: " + reply);
      }
    } catch (IOException e) {
      return failed(e);
    }
  }

  @Override
  public Status scan(String table, String startkey, int recordcount, Set<String> fields,
      Vector<HashMap<String, ByteIterator>> result) {
    return Status.NOT_IMPLEMENTED;
  }
}
